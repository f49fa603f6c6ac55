"""The built-in data sets nanolm makes itself: tool-use conversations, arithmetic RL prompts, digit block tasks, preference pairs.

Each generator writes its data in one of the formats nanolm/data/kinds/ reads
(`nanolm data tools|arith|blocks`, the quickstart, tests and docs use them);
none of them is part of the prepare pipeline.
"""
