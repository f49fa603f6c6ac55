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
from typing import Mapping, Sequence

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
