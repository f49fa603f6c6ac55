"""The control tokens and tags of nanolm's tokenizers, below both the tokenizer and the chat format that use them.

A tokenizer nanolm trains holds them first, with ids 0 ... 8: the end of a text and the two turn markers of
ChatML, then the tags of tool calls, tool results and reasoning, which the chat format writes
(nanolm/chat/templates.py). A loaded tokenizer finds its own ids by name (`Tokenizer.eot_id`, ...).
"""

SPECIAL_TOKENS: list[str] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The tags of tool calls and reasoning (the chat format renders them), ids 3 ... 8 in a tokenizer nanolm trains.
TAG_TOKENS: list[str] = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
EOT, IM_START, IM_END = SPECIAL_TOKENS
TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END, THINK, THINK_END = TAG_TOKENS
# The ids of the control tokens in a tokenizer nanolm trains; a loaded one has its own (`Tokenizer.eot_id`, ...).
EOT_ID = 0
IM_START_ID = 1
IM_END_ID = 2
