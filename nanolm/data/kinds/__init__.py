"""The kinds of prepared data, one class each (nanolm/data/kinds/base.py says what a kind is), registered by
name: text (documents for pretraining), chat (conversations), pairs (preference pairs), prompts (RL prompts)
and blocks (input and output blocks).

`get(name)` is the kind `nanolm prepare --format name` writes, the loader reads and `nanolm tokenizer train
--format name` trains on (`iter_texts`); `register(cls)` adds one.
"""

from nanolm.data.kinds.base import (DataKind, PrepareConfig, UnitKind, choices, get, iter_texts, mix_refusal, names,
                                    register, stream_kind, texts_help)
from nanolm.data.kinds.blocks import BlocksKind
from nanolm.data.kinds.chat import ChatKind
from nanolm.data.kinds.pairs import PairsKind
from nanolm.data.kinds.prompts import PromptsKind
from nanolm.data.kinds.text import TextKind

for _kind in (TextKind, ChatKind, PairsKind, PromptsKind, BlocksKind):
    register(_kind)

__all__ = ["DataKind", "PrepareConfig", "UnitKind", "choices", "get", "iter_texts", "mix_refusal", "names",
           "register", "stream_kind", "texts_help", "BlocksKind", "ChatKind", "PairsKind", "PromptsKind", "TextKind"]
