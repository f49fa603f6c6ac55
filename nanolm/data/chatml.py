r"""ChatML, the chat format of nanolm's models: its text, its ids with a loss mask, its roles, its truncation.

Every other module renders, checks or cuts a conversation through this one.

Text. Each message renders as `<|im_start|>{role}\n{content}<|im_end|>\n`
(`message_text`), and a prompt that asks for a reply ends with
`<|im_start|>assistant\n` (`GENERATION_PROMPT`): the template of
Qwen2-Instruct and MiniMind. `render_chat` is the Python rendering;
`CHAT_TEMPLATE` is the same template in Jinja, the one tokenizer_config.json
(and a GGUF export) carries for `transformers.apply_chat_template`, and the
two give the same text for any messages (tests/test_tokenizer.py checks it
through Jinja and transformers).

`OLLAMA_TEMPLATE` is the same template in Go's text/template, for the
TEMPLATE of an ollama Modelfile (`nanolm export ollama`): ollama hands it the
conversation as `.Messages` (each with `.Role` and `.Content`; a Modelfile
SYSTEM arrives as a first system message), and the template ends with the
generation prompt itself, as ollama's own ChatML template does.
tests/test_export_ollama.py renders it with Go's text/template.

Roles (`ROLES`): one rule per role says whether its messages train (their
tokens are targets in fine-tuning data) and which other names API clients
may use for it (OpenAI's "developer" is the system role). Adding a role is
one entry there. No content may hold a control string (`control_in`):
rendered, it would open or close turns the conversation does not have.

Ids and loss mask (`render_with_mask`, what `nanolm prepare` stores): exactly
the ids of `encode(render_chat(messages))`, computed from the ids of each
message's `role\ncontent` (`segment_text`) encoded on its own: the tokenizer
splits its input at the control tokens before anything else, so the pieces
between them tokenize the same alone as in the whole text
(`check_piecewise` checks this on the tokenizer in use). The mask is 1 on the
content tokens and the closing `<|im_end|>` of each message whose role trains
(the assistant replies), 0 on the other messages, on the template's
scaffolding (`<|im_start|>`, `assistant\n`, the `\n` after `<|im_end|>`).
When a reply starts with two or more whitespace characters, its first token
joins the `\n` of `assistant\n` with that whitespace; the token carries reply
text, so it is a target. Preference data (`final_only`) has the mask on the
final reply only: the earlier turns, assistant replies included, are the
prompt that both conversations of a pair continue.

Truncation (`fit_conversation`; `nanolm prepare` applies it at max_tokens and
the loader at seq_len + 1): a conversation longer than `max_tokens` tokens
(`<|endoftext|>` not counted) keeps its system message and drops its oldest
user/assistant pairs until it fits. If the last pair alone does not fit, the
final reply is cut at the end to fit: a reply cut inside its content keeps no
`<|im_end|>`, so the model is never taught to end a turn where the text did
not (one that loses only its last `\n` keeps it, being whole). A conversation
whose system message, last user turn and first reply token do not fit (no
target would be left) is skipped. A preference pair (`fit_pair`) drops the
same old turns from both conversations, so that they keep one prompt, and
cuts each final reply at the end if need be; it is skipped when either would
keep no target.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from nanolm.errors import UserError
from nanolm.tokenizer import IM_END_ID, IM_START_ID, SPECIAL_TOKENS

IM_START = SPECIAL_TOKENS[IM_START_ID]
IM_END = SPECIAL_TOKENS[IM_END_ID]
TURN_SEP = "\n"  # after each <|im_end|>

# One line with no newline between tags, so the output does not depend on the
# trim_blocks/lstrip_blocks settings of whoever renders it (transformers sets both).
CHAT_TEMPLATE: str = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Role:
    """The rule of one role: whether its messages train (their content and closing <|im_end|> are loss
    targets) and the other names API clients may give it."""

    trains: bool
    aliases: tuple[str, ...] = ()


ROLES: dict[str, Role] = {
    "system": Role(trains=False, aliases=("developer",)),  # "developer": OpenAI's newer name for it
    "user": Role(trains=False),
    "assistant": Role(trains=True),
}
# Every role name a request may use -> the role it renders as (each role, then its aliases).
ROLE_NAMES: dict[str, str] = {name: role for role, rule in ROLES.items() for name in (role, *rule.aliases)}

# Rendered into the text, these would open or close turns the data does not have.
_CONTROL = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def control_in(text: str) -> str | None:
    """The first control string (`<|im_start|>`, ...) in text, or None when it holds none."""
    m = _CONTROL.search(text)
    return m.group() if m else None


# --- text ----------------------------------------------------------------------------------------


def segment_text(role: str, content: str) -> str:
    """The text of a message between its control tokens: what is encoded on its own (see module doc)."""
    return f"{role}\n{content}"


def message_text(role: str, content: str) -> str:
    """The ChatML text of one message."""
    return f"{IM_START}{segment_text(role, content)}{IM_END}{TURN_SEP}"


GENERATION_PROMPT = IM_START + segment_text("assistant", "")

# Every message as `message_text` renders it, then the generation prompt (see the module doc).
OLLAMA_TEMPLATE: str = ("{{ range .Messages }}" + message_text("{{ .Role }}", "{{ .Content }}") + "{{ end }}"
                        + GENERATION_PROMPT)


def conversation_text(messages: Sequence[tuple[str, str]], add_generation_prompt: bool = False) -> str:
    """The ChatML text of (role, content) messages, with the generation prompt at the end if asked."""
    text = "".join(message_text(role, content) for role, content in messages)
    return text + GENERATION_PROMPT if add_generation_prompt else text


def render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """ChatML text of {"role", "content"} messages, exactly what CHAT_TEMPLATE renders."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UserError(f"chat message {i}: expected {{\"role\": str, \"content\": str}}, got {m!r:.80}; "
                            "give every message a string role and a string content")
    return conversation_text([(m["role"], m["content"]) for m in messages], add_generation_prompt)


# --- ids and loss mask ---------------------------------------------------------------------------


def render_with_mask(messages: Sequence[tuple[str, str]], segment_ids: Sequence[Sequence[int]],
                     newline_ids: Sequence[int], byte_lengths: Sequence[int], *,
                     final_only: bool = False) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a conversation, from the ids of each message's `segment_text`.

    messages: (role, content) pairs of known roles; segment_ids[i]: the ids of segment_text of message i;
    newline_ids: the ids of TURN_SEP; byte_lengths[id]: UTF-8 bytes of each token. final_only: the mask on
    the last message only (preference data). Gives (ids, mask) of equal length, ids equal to
    encode(conversation_text(messages)) (see module doc).
    """
    ids: list[int] = []
    mask: list[int] = []
    for i, ((role, _), seg) in enumerate(zip(messages, segment_ids)):
        ids.append(IM_START_ID)
        ids.extend(seg)
        ids.append(IM_END_ID)
        ids.extend(newline_ids)
        if ROLES[role].trains and (not final_only or i == len(messages) - 1):
            # The content starts at the first token that reaches past the bytes of "{role}\n".
            prefix, acc, k = len(segment_text(role, "").encode("utf-8")), 0, 0
            while k < len(seg) and acc + byte_lengths[seg[k]] <= prefix:
                acc += byte_lengths[seg[k]]
                k += 1
            mask.extend([0] * (1 + k))
            mask.extend([1] * (len(seg) - k + 1))  # content and <|im_end|>
            mask.extend([0] * len(newline_ids))
        else:
            mask.extend([0] * (len(seg) + 2 + len(newline_ids)))
    return ids, mask


def check_piecewise(messages: Sequence[tuple[str, str]], ids: list[int], encode: Callable[[str], list[int]],
                    tokenizer_file: str) -> None:
    """UserError unless `ids` (render_with_mask of messages) are encode(conversation_text(messages)).

    Holds for any tokenizer that splits at its special tokens; `nanolm prepare` checks it once per batch.
    """
    if ids != encode(conversation_text(messages)):
        raise UserError(f"{tokenizer_file}: encoding a conversation piece by piece does not give the ids of "
                        "the whole rendered conversation, so its loss mask cannot be placed; use a tokenizer "
                        "made by `nanolm tokenizer train` (its control tokens are special tokens)")


# --- truncation ----------------------------------------------------------------------------------


def fit_conversation(ids: np.ndarray, mask: np.ndarray,
                     max_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A rendered conversation (no trailing EOT) cut to at most max_tokens tokens by the truncation
    policy of the module doc, or None when no target would be left. Returned as is when it fits.

    Message boundaries are found at the <|im_start|> tokens (no content may hold one), and a
    conversation with an odd number of messages is the one that starts with a system message.
    """
    if len(ids) <= max_tokens:
        return ids, mask
    return _cut(ids, mask, _first_kept(ids, max_tokens), max_tokens)


def fit_pair(chosen: tuple[np.ndarray, np.ndarray], rejected: tuple[np.ndarray, np.ndarray],
             max_tokens: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None:
    """The two rendered conversations of a preference pair, (ids, mask) each with no trailing EOT, cut
    to at most max_tokens tokens each by the truncation policy of `fit_conversation`, dropping the same
    old turns from both so that they still share their prompt; None when either would keep no target.
    Returned as is when both fit.
    """
    if len(chosen[0]) <= max_tokens and len(rejected[0]) <= max_tokens:
        return chosen, rejected
    first = max(_first_kept(chosen[0], max_tokens), _first_kept(rejected[0], max_tokens))
    c, r = _cut(*chosen, first, max_tokens), _cut(*rejected, first, max_tokens)
    return None if c is None or r is None else (c, r)


def _message_starts(ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Where each message starts, and the length of the system message (0 when there is none)."""
    starts = np.flatnonzero(ids == IM_START_ID)
    return starts, int(starts[1]) if len(starts) % 2 else 0


def _first_kept(ids: np.ndarray, max_tokens: int) -> int:
    """The index of the oldest message (a user turn) kept when the system message and the messages from
    it on fit in max_tokens; that of the last user turn when even the last pair alone does not fit."""
    starts, head = _message_starts(ids)
    n, n_msgs = len(ids), len(starts)
    for first in range(n_msgs % 2, n_msgs, 2):
        if head + n - int(starts[first]) <= max_tokens:
            return first
    return n_msgs - 2


def _cut(ids: np.ndarray, mask: np.ndarray, first: int,
         max_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The system message and the messages from `first` on, cut at the end to max_tokens tokens;
    None when no target is left."""
    starts, head = _message_starts(ids)
    keep = np.r_[0:head, int(starts[first]):len(ids)][:max_tokens]
    if not mask[keep].any():
        return None
    return ids[keep], mask[keep]
