"""The chat format of nanolm's models: every other module renders, checks, encodes, cuts or reads a conversation
through this package, which imports nothing of nanolm's but the special tokens and `UserError`.

- messages.py: messages, tools and reasoning, read from every shape users and API clients send; their order
- templates.py: the two layouts (Qwen3-style with tools and <think>, plain ChatML) as Python spans, Jinja and
  Go (ollama) templates, and a tokenizer's own Jinja template (`TemplateFormat`); which a tokenizer renders
- encoding.py: a rendered conversation's ids and loss mask, placed by the bytes each token spells
- truncation.py: a conversation or a preference pair cut to a token budget by whole exchanges
- replies.py: a generated reply, streamed or whole, read back into reasoning, content and tool calls

The names callers use are importable from the package itself (`from nanolm.chat import Message`); the
package's own modules import each other by submodule, so that importing one never goes through this file.
"""

from nanolm.chat.encoding import EXCHANGE, TARGET, check_spelling, encode_chat, encode_chats
from nanolm.chat.messages import (ROLE_NAMES, ROLES, ChatError, Conversation, Message, Role, ToolCall,
                                  check_conversation, checked_text, control_in, message_from_dict, split_reasoning,
                                  tool_call_from_dict, tools_from_value)
from nanolm.chat.replies import (Call, Content, Event, Reasoning, ReplyParser, TokenKinds, parse_bare_calls,
                                 parse_call, parse_tool_call, read_reply)
from nanolm.chat.templates import (CHAT_TEMPLATE, CHATML, QWEN3, ChatFormat, Span, TemplateFormat, format_of,
                                   render_chat)
from nanolm.chat.truncation import fit_conversation, fit_pair

__all__ = [
    "EXCHANGE", "TARGET", "check_spelling", "encode_chat", "encode_chats",
    "ROLE_NAMES", "ROLES", "ChatError", "Conversation", "Message", "Role", "ToolCall", "check_conversation",
    "checked_text", "control_in", "message_from_dict", "split_reasoning", "tool_call_from_dict", "tools_from_value",
    "Call", "Content", "Event", "Reasoning", "ReplyParser", "TokenKinds", "parse_bare_calls", "parse_call",
    "parse_tool_call", "read_reply",
    "CHAT_TEMPLATE", "CHATML", "QWEN3", "ChatFormat", "Span", "TemplateFormat", "format_of", "render_chat",
    "fit_conversation", "fit_pair",
]
