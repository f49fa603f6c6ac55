"""Moved to nanolm/data/kinds/prompts.py (the RL prompts kind); these names stay here for nanolm/train/grpo.py
until it imports them from there."""

from nanolm.data.kinds.prompts import PromptBatch, last_user_text, read_records, records_file

__all__ = ["PromptBatch", "last_user_text", "read_records", "records_file"]
