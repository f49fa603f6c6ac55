"""Tool calls held to the tools' schemas while the model writes them: a grammar that wakes on `<tool_call>`.

A small model that has learnt *when* to call a tool often cannot yet write the call: a brace too few, a key
misspelt, a name that is no tool's. `ToolCallGuide` follows one row's tokens; outside a call it masks almost
nothing, so the model still decides whether to call, which tool and with what arguments. From the
moment the model opens a call (the bytes `<tool_call>`) until the call is closed, only tokens that keep the
text a prefix of a well-formed call are allowed:

    \\n{"name": "<a tool offered>", "arguments": {<that tool's parameters>}}\\n</tool_call>

laid out as the chat template renders calls (`json.dumps` spacing: `", "` and `": "`), so the guided text is
the layout the model was trained on. Arguments follow the tool's JSON schema: its properties in the schema's
order, each required one present and optional ones skippable; `string`, `number`, `integer`, `boolean`,
`null`, `enum`, nested `object` / `array`; any other schema (or none) admits any JSON value. llama.cpp's
server applies such a "lazy" grammar to tool calls in the same way.

The grammar runs on bytes (tokens are byte strings, `Tokenizer.token_bytes`), as a set of parse
configurations: each is a tuple of items still to match, the first one possibly part-matched, so an
ambiguity (a number that may go on or end) is several configurations until a byte settles it. The mask of a
state walks the vocabulary in byte order, sharing each prefix's parse and skipping every token that starts
with a dead prefix; inside a free string, where any token without a quote, backslash or control byte keeps
the state as it is, only the tokens that have one are walked. Masks are cached by state.

The tags are read as bytes, never as token ids: `<tool_call>` may be one added token (nanolm's tokenizers) or
text the model spells in several (SmolLM2's, whose template has no tools section: nanolm/chat/templates.py).
Spelt in pieces, the token that finishes the trigger may carry the call's first bytes too (`>\n{"`); outside a
call the guide masks the few tokens that would finish it and go on as no call of the offered tools can
(`GuideVocab.entry_mask`, cached by how much of the trigger the text ends with), so the call it opens is
guided from its first byte.

The engine knows nothing of text: it asks a row's guide for `allowed()` (None: nothing masked) before each
draw and tells it `advance(token)` after, and gives each of a request's n samples its own `fork()`.
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import torch

TRIGGER = b"<tool_call>"
_CLOSE = b"}\n</tool_call>"
_HEAD = b'\n{"name": "'
_QUOTE, _BACKSLASH = 0x22, 0x5C
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_DIGITS = frozenset(b"0123456789")

# JSON numbers: 0 start, 1 after '-', 2 a leading zero, 3 integer digits, 4 after '.', 5 fraction digits,
# 6 after 'e', 7 after the exponent's sign, 8 exponent digits. A number may end in FINAL states.
_FINAL = frozenset({2, 3, 5, 8})


def _num_next(state: int, b: int, frac: bool) -> int | None:
    digit = b in _DIGITS
    if state == 0:
        return 1 if b == 0x2D else 2 if b == 0x30 else 3 if digit else None
    if state == 1:
        return 2 if b == 0x30 else 3 if digit else None
    if state in (2, 3):
        if state == 3 and digit:
            return 3
        if frac and b == 0x2E:
            return 4
        return 6 if frac and b in (0x65, 0x45) else None
    if state in (4, 5):
        if digit:
            return 5
        return 6 if state == 5 and b in (0x65, 0x45) else None
    if state == 6:
        return 7 if b in (0x2B, 0x2D) else 8 if digit else None
    return 8 if digit else None  # 7, 8


def _lit(data: bytes) -> tuple:
    return ("lit", data, 0)


_STR = ("str", 0)  # the inside of a string, its opening quote already matched; ends with the closing quote
_VALUE = ("value",)


def _expand(item: tuple) -> list[tuple]:
    """A non-terminal item's alternatives, each a tuple of items that replaces it."""
    kind = item[0]
    if kind == "alt":
        return list(item[1])
    if kind == "value":
        return [(_lit(b"{"), ("members", True, (_VALUE,))), (_lit(b"["), ("elems", True, (_VALUE,))),
                (_lit(b'"'), _STR),
                (("num", 0, True),), (_lit(b"true"),), (_lit(b"false"),), (_lit(b"null"),)]
    if kind == "members":  # the rest of an object of any keys, each value item[2]
        lead = b'"' if item[1] else b', "'
        return [(_lit(b"}"),), (_lit(lead), _STR, _lit(b": "), *item[2], ("members", False, item[2]))]
    if kind == "elems":  # the rest of an array of item[2]s
        lead = () if item[1] else (_lit(b", "),)
        return [(_lit(b"]"),), (*lead, *item[2], ("elems", False, item[2]))]
    if kind == "props":  # the schema's properties from item[2] on, in order; the closing brace follows
        props, start, first = item[1], item[2], item[3]
        out: list[tuple] = []
        if all(not required for _, _, required in props[start:]):
            out.append(())
        for j in range(start, len(props)):
            key, value, required = props[j]
            out.append((_lit((b"" if first else b", ") + key + b": "), *value, ("props", props, j + 1, False)))
            if required:
                break  # a required property cannot be skipped
        return out
    raise AssertionError(f"unknown grammar item {kind}")


def _feed(items: tuple, b: int) -> list[tuple]:
    """The configurations that `items` becomes on the byte b (none: b cannot come next)."""
    if not items:
        return []
    head, rest = items[0], items[1:]
    kind = head[0]
    if kind == "lit":
        data, i = head[1], head[2]
        if data[i] != b:
            return []
        return [rest if i + 1 == len(data) else (("lit", data, i + 1), *rest)]
    if kind == "str":
        state = head[1]
        if state == 0:
            if b == _QUOTE:
                return [rest]
            if b == _BACKSLASH:
                return [(("str", 1), *rest)]
            return [] if b < 0x20 else [items]
        if state == 1:
            if b in _ESCAPES:
                return [(_STR, *rest)]
            return [(("str", 5), *rest)] if b == 0x75 else []  # \u and four hex digits
        if b not in _HEX:
            return []
        return [(_STR if state == 2 else ("str", state - 1), *rest)]
    if kind == "num":
        state, frac = head[1], head[2]
        out = []
        nxt = _num_next(state, b, frac)
        if nxt is not None:
            out.append((("num", nxt, frac), *rest))
        if state in _FINAL:
            out += _feed(rest, b)
        return out
    out = []
    for alternative in _expand(head):
        out += _feed((*alternative, *rest), b)
    return out


State = frozenset  # of configurations (tuples of items)
_DONE: State = frozenset({()})  # the call is complete: what follows is free text again


def step(state: State, data: bytes) -> State:
    """The state after `data` (empty: the bytes cannot be part of a call); _DONE once the call is closed (the
    bytes after the close are not read)."""
    for b in data:
        if state == _DONE:
            return state
        state = frozenset(c for config in state for c in _feed(config, b))
        if not state:
            return state
        if () in state:
            return _DONE
    return state


# What a schema may hold for the guide to follow it: the parse configurations a state carries, and so the cost of
# each token's mask, grow with the alternatives a value may start as (enum values, anyOf alternatives, types) and
# an object's optional properties (measured with a 6,400-token vocabulary, the worst mask of a call: 6 ms at 64
# enum values, 27 ms at 256, 220 ms at 1,024, 2.9 s at 4,096).
MAX_ENUM = 64
MAX_PROPERTIES = 64
MAX_DEPTH = 8
SCHEMA_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
# Keywords the guide does not follow: a call held to the rest of the schema could break them (a reference it
# cannot resolve, a branch it cannot exclude), so a schema holding one is refused rather than guided wrongly.
_UNFOLLOWED = ("$ref", "$defs", "definitions", "$dynamicRef", "allOf", "oneOf", "not", "if", "then", "else",
               "patternProperties", "prefixItems", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
               "contains", "propertyNames", "dependentSchemas", "dependentRequired", "dependencies")
# Keywords checked for their type only: constraints on a value that the guide does not hold a call to (the
# model may break them; the tool gets the call as written), and annotations.
_TEXT_KEYS = ("description", "title", "format", "pattern", "$schema", "$id", "$comment")
_COUNT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class SchemaError(ValueError):
    """A tool's schema the guide cannot follow (or not at a bounded cost); `place` names where, as
    `tools[0].function.parameters.properties.x.enum`."""

    def __init__(self, place: str, problem: str) -> None:
        super().__init__(f"{place}: {problem}")
        self.place = place


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, bool, int, float))


def _breadth(schema: dict) -> int:
    """How many alternatives a value of `schema` may start as: the live parse configurations at its start."""
    if isinstance(schema.get("enum"), list):
        return len(schema["enum"])
    if isinstance(schema.get("anyOf"), list):
        return sum(_breadth(s) for s in schema["anyOf"] if isinstance(s, dict))
    kind = schema.get("type")
    return len(kind) if isinstance(kind, list) else 1


def _check_node(schema: Any, at: str, depth: int) -> None:
    """SchemaError unless `schema` and every schema in it are in the subset `_value_items` follows, within the
    limits; `at` names it, `depth` counts the schemas it is nested in."""
    if not isinstance(schema, dict):
        raise SchemaError(at, f"must be a JSON schema object, not {_json_kind(schema)}")
    if depth > MAX_DEPTH:
        raise SchemaError(at, f"nested more than {MAX_DEPTH} levels deep; the tool-call guide follows at most "
                              f"{MAX_DEPTH}")
    for key in _UNFOLLOWED:
        if key in schema:
            raise SchemaError(f"{at}.{key}", "the tool-call guide does not follow this keyword; write the schema "
                                             "without it (anyOf, enum, type, properties and items are followed)")
    for key in _TEXT_KEYS:
        if key in schema and not isinstance(schema[key], str):
            raise SchemaError(f"{at}.{key}", f"must be a string, not {_json_kind(schema[key])}")
    for key in _COUNT_KEYS:
        v = schema.get(key)
        if key in schema and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise SchemaError(f"{at}.{key}", f"must be a whole number >= 0, not {json.dumps(v)[:40]}")
    for key in _NUMBER_KEYS:
        v = schema.get(key)
        if key in schema and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise SchemaError(f"{at}.{key}", f"must be a number, not {json.dumps(v)[:40]}")
    kind = schema.get("type")
    if "type" in schema:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or len(set(map(str, kinds))) != len(kinds) or not all(k in SCHEMA_TYPES for k in kinds):
            raise SchemaError(f"{at}.type", f"{json.dumps(kind)[:80]} is not a JSON type or a list of distinct "
                                            f"ones; use {', '.join(SCHEMA_TYPES)}")
    if "enum" in schema:
        enum = schema["enum"]
        if not isinstance(enum, list) or not enum or not all(_scalar(v) for v in enum):
            raise SchemaError(f"{at}.enum", "must be a non-empty list of strings, numbers, booleans or null")
        if len(enum) > MAX_ENUM:
            raise SchemaError(f"{at}.enum", f"{len(enum)} values; the tool-call guide follows at most {MAX_ENUM} "
                                            "(each token's cost grows with them); give fewer, or a plain string")
    if "const" in schema and not _scalar(schema["const"]):
        raise SchemaError(f"{at}.const", "must be a string, number, boolean or null")
    if "anyOf" in schema:
        alts = schema["anyOf"]
        if not isinstance(alts, list) or not alts:
            raise SchemaError(f"{at}.anyOf", "must be a non-empty list of schemas")
        beside = [k for k in ("type", "enum", "const", "properties", "items") if k in schema]
        if beside:
            raise SchemaError(f"{at}.anyOf", f"given beside {beside[0]}, which the tool-call guide cannot combine "
                                             f"with it; move {beside[0]} into each alternative")
        for i, sub in enumerate(alts):
            _check_node(sub, f"{at}.anyOf[{i}]", depth + 1)
        if _breadth(schema) > MAX_ENUM:
            raise SchemaError(f"{at}.anyOf", f"{_breadth(schema)} alternatives in all (enum values and types "
                                             f"counted); the tool-call guide follows at most {MAX_ENUM}")
    props = schema.get("properties")
    if "properties" in schema:
        if not isinstance(props, dict):
            raise SchemaError(f"{at}.properties", f"must be an object of property schemas, not {_json_kind(props)}")
        if len(props) > MAX_PROPERTIES:
            raise SchemaError(f"{at}.properties", f"{len(props)} properties; the tool-call guide follows at most "
                                                  f"{MAX_PROPERTIES}")
        for key, sub in props.items():
            _check_node(sub, f"{at}.properties.{key[:64]}", depth + 1)
    if "required" in schema:
        required = schema["required"]
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise SchemaError(f"{at}.required", "must be a list of property names")
        missing = [k for k in required if not isinstance(props, dict) or k not in props]
        if missing:
            raise SchemaError(f"{at}.required", f"names {missing[0][:64]!r}, which properties does not list; the "
                                                "tool-call guide writes only listed properties")
    extra = schema.get("additionalProperties")
    if "additionalProperties" in schema and not isinstance(extra, bool):
        _check_node(extra, f"{at}.additionalProperties", depth + 1)
    if "items" in schema:
        if isinstance(schema["items"], list):
            raise SchemaError(f"{at}.items", "a list of schemas (one per position) is not followed by the tool-call "
                                             "guide; give one schema for every item")
        _check_node(schema["items"], f"{at}.items", depth + 1)


def _json_kind(v: Any) -> str:
    """What a JSON value is, for a message: `null`, `a string`, `a list` ..."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    return ("a string" if isinstance(v, str) else "a number" if isinstance(v, (int, float))
            else "a list" if isinstance(v, list) else "an object")


def check_schema(tool: Any, where: str) -> None:
    """SchemaError naming the place in `tool` (an OpenAI tool object or a bare function) whose `parameters` the
    guide cannot follow, checked whole: a keyword of the wrong type (`"enum": "xyz"`, `"type": "bogus"`,
    `"required": "a"`), a schema that is not an object (`"items": 1`, `"parameters": null`), a keyword the guide
    does not follow (`$ref`, `oneOf`, an `items` list ...), or more than the guide follows at a bounded cost per
    token at any depth: more than MAX_ENUM alternatives for a value (enum values, anyOf, types), an object of more
    than MAX_PROPERTIES properties, a schema nested more than MAX_DEPTH deep. A tool that is not an object with a
    `function` object is left to the chat format to name."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or "parameters" not in fn:
        return  # no parameters: the arguments are any object
    at = f"{where}{'.function' if 'function' in tool else ''}.parameters"
    params = fn["parameters"]
    if not isinstance(params, dict):
        raise SchemaError(at, f"must be a JSON schema object (the arguments' schema), not {_json_kind(params)}")
    if params.get("type", "object") != "object":
        raise SchemaError(f"{at}.type", f"the arguments are an object, so their schema's type is \"object\", not "
                                        f"{json.dumps(params['type'])[:80]}")
    if "anyOf" in params or "enum" in params or "const" in params:
        key = next(k for k in ("anyOf", "enum", "const") if k in params)
        raise SchemaError(f"{at}.{key}", "the arguments' schema names their properties; give this keyword to a "
                                         "property instead")
    _check_node(params, at, 1)


def _value_items(schema: Any) -> tuple:
    """The items of a JSON value that `schema` (checked by `check_schema`, or anything: what it does not say
    admits any value) describes."""
    if not isinstance(schema, dict):
        return (_VALUE,)
    enum = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(enum, list) and enum and all(_scalar(v) for v in enum):
        return (("alt", tuple((_lit(json.dumps(v, ensure_ascii=False).encode()),) for v in enum)),)
    alts = schema.get("anyOf")
    if isinstance(alts, list) and alts:
        return (("alt", tuple(_value_items(s) for s in alts)),)
    kind = schema.get("type")
    if kind is None:  # untyped, but its keywords say which kind of value
        kind = "object" if "properties" in schema else "array" if isinstance(schema.get("items"), dict) else None
    if isinstance(kind, list):
        alts = tuple(_value_items({**schema, "type": k}) for k in kind if isinstance(k, str))
        return (("alt", alts),) if alts else (_VALUE,)
    if kind == "string":
        return (_lit(b'"'), _STR)
    if kind in ("number", "integer"):
        return (("num", 0, kind == "number"),)
    if kind == "boolean":
        return (("alt", ((_lit(b"true"),), (_lit(b"false"),))),)
    if kind == "null":
        return (_lit(b"null"),)
    if kind == "object":
        return _object_items(schema)
    if kind == "array":
        return (_lit(b"["), ("elems", True, _value_items(schema.get("items"))))
    return (_VALUE,)


def _object_items(schema: Any) -> tuple:
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not props:  # no properties named: any object, its values as
        extra = schema.get("additionalProperties") if isinstance(schema, dict) else None  # additionalProperties says
        if extra is False:
            return (_lit(b"{}"),)
        return (_lit(b"{"), ("members", True, _value_items(extra) if isinstance(extra, dict) else (_VALUE,)))
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    entries = tuple((json.dumps(str(key), ensure_ascii=False).encode(), _value_items(sub), key in required)
                    for key, sub in props.items())
    return (_lit(b"{"), ("props", entries, 0, True), _lit(b"}"))


def call_state(tools: Iterable[Any]) -> State:
    """The state just after `<tool_call>`: a call of one of `tools` (OpenAI tool objects or bare functions)."""
    alternatives = []
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or '"' in name or "\\" in name:
            continue  # not a name a call can hold as the template writes it
        alternatives.append((_lit(name.encode() + b'", "arguments": '), *_object_items(fn.get("parameters")),
                             _lit(_CLOSE)))
    if not alternatives:
        raise ValueError("no tool with a usable name to guide calls to")
    return frozenset({(_lit(_HEAD), ("alt", tuple(alternatives)))})


def _trigger_next(written: int, b: int) -> int:
    """How much of TRIGGER the text ends with after byte b, when it ended with its first `written` bytes."""
    data = TRIGGER[:written] + bytes([b])
    return next(k for k in range(min(len(data), len(TRIGGER)), -1, -1) if data.endswith(TRIGGER[:k]))


def _trigger_written(tail: bytes) -> int:
    """How much of TRIGGER (short of all of it) the text ends with, from its last bytes."""
    return next(k for k in range(min(len(tail), len(TRIGGER) - 1), -1, -1) if tail.endswith(TRIGGER[:k]))


def past_prefix(prefix: bytes) -> bytes | None:
    """The least byte string greater than every string that starts with `prefix` (None: there is none)."""
    p = prefix.rstrip(b"\xff")
    return p[:-1] + bytes([p[-1] + 1]) if p else None


class GuideVocab:
    """A vocabulary as the guide reads it: each id's bytes, sorted for the prefix walk, and masks by state.

    token_bytes: the bytes each id stands for (`Tokenizer.token_bytes()`). size: the model's vocabulary (it
    may be larger than the tokenizer's). never: ids never allowed inside a call (the control tokens, which
    stand for their own text but end or open turns). tags: ids of tag tokens (`</tool_call>`, `<think>` ...),
    allowed only where the call's layout spells them, never inside a string. `of(tokenizer, size)` builds
    one from a Tokenizer.
    """

    def __init__(self, token_bytes: Sequence[bytes], size: int, *, never: Iterable[int] = (),
                 tags: Iterable[int] = (), device: torch.device | str = "cpu", cache_size: int = 512) -> None:
        self.token_bytes = list(token_bytes)
        self.size, self.device = size, torch.device(device)
        never, tags = set(never), set(tags)
        spelled = sorted((b, i) for i, b in enumerate(self.token_bytes[:size]) if b and i not in never)
        self._keys, self._ids = [b for b, _ in spelled], [i for _, i in spelled]
        special = [(b, i) for b, i in spelled
                   if i not in tags and any(c == _QUOTE or c == _BACKSLASH or c < 0x20 for c in b)]
        self._special_keys, self._special_ids = [b for b, _ in special], [i for _, i in special]
        walked = set(self._special_ids) | tags
        plain = torch.zeros(size, dtype=torch.bool)
        plain[[i for _, i in spelled if i not in walked]] = True
        self._plain = plain
        self._cache: OrderedDict[State, torch.Tensor] = OrderedDict()
        self._cache_size = cache_size
        # Only a token that holds the trigger's last byte can finish writing it (`entry_mask`).
        self._closers = [i for _, i in spelled if TRIGGER[-1] in self.token_bytes[i]]
        self._entry: dict[tuple[State, int], torch.Tensor | None] = {}

    @classmethod
    def of(cls, tokenizer: Any, size: int, device: torch.device | str = "cpu") -> "GuideVocab":
        """The guide's view of a `nanolm.tokenizer.Tokenizer` for a model of `size` ids."""
        return cls(tokenizer.token_bytes(), size, never=(tokenizer.eot_id, tokenizer.im_start_id,
                                                          tokenizer.im_end_id),
                   tags=tokenizer.tag_ids.values(), device=device)

    def _walk(self, state: State, keys: list[bytes], ids: list[int]) -> list[int]:
        """The ids among keys (sorted) whose bytes `state` can take."""
        allowed: list[int] = []
        stack: list[tuple[bytes, State]] = [(b"", state)]
        i, n = 0, len(keys)
        while i < n:
            token = keys[i]
            while not token.startswith(stack[-1][0]):
                stack.pop()
            prefix, s = stack[-1]
            dead = None
            for j in range(len(prefix), len(token)):
                if s == _DONE:
                    break
                s = step(s, token[j:j + 1])
                if not s:
                    dead = token[:j + 1]
                    break
                stack.append((token[:j + 1], s))
            if dead is None:
                allowed.append(ids[i])
                i += 1
            else:  # no token that starts with `dead` can come next
                end = past_prefix(dead)
                i = n if end is None else bisect.bisect_left(keys, end, i + 1)
        return allowed

    def entry_mask(self, start: State, written: int) -> torch.Tensor | None:
        """bool (size,): the ids that may come next outside a call, the text ending with the first `written`
        bytes of TRIGGER: all but those that would finish the trigger and go on as no call from `start` can
        (`call_state`); None when that is every id. Cached by (start, written)."""
        key = (start, written)
        if key in self._entry:
            return self._entry[key]
        banned = []
        for i in self._closers:
            data, k = self.token_bytes[i], written
            for j, b in enumerate(data):
                k = _trigger_next(k, b)
                if k == len(TRIGGER):
                    if not step(start, data[j + 1:]):
                        banned.append(i)
                    break
        out = None
        if banned:
            out = torch.ones(self.size, dtype=torch.bool)
            out[banned] = False
            out = out.to(self.device)
        if len(self._entry) >= self._cache_size:
            self._entry.clear()
        self._entry[key] = out
        return out

    def mask(self, state: State) -> torch.Tensor:
        """bool (size,): the ids that may come next in `state`."""
        hit = self._cache.get(state)
        if hit is not None:
            self._cache.move_to_end(state)
            return hit
        if all(config and config[0] == _STR for config in state):  # inside a free string
            out = self._plain.clone()
            ids = self._walk(state, self._special_keys, self._special_ids)
        else:
            out = torch.zeros(self.size, dtype=torch.bool)
            ids = self._walk(state, self._keys, self._ids)
        if ids:
            out[ids] = True
        out = out.to(self.device)
        self._cache[state] = out
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return out


class ToolCallGuide:
    """One row's guide: free text until the row writes `<tool_call>`, then the call grammar until it closes.

    A row may make several calls; each is guided. Should the allowed set ever come out empty (a tokenizer that
    cannot spell a needed byte), the guide lets the row go on unguided rather than stop it.
    """

    def __init__(self, vocab: GuideVocab, tools: Sequence[Any]) -> None:
        self.vocab = vocab
        self.start = call_state(tools)
        self.state: State | None = None  # None: outside a call
        self._tail = b""  # the last bytes written outside a call, to spot the trigger

    def fork(self) -> "ToolCallGuide":
        twin = object.__new__(ToolCallGuide)
        twin.vocab, twin.start, twin.state, twin._tail = self.vocab, self.start, self.state, self._tail
        return twin

    @property
    def in_call(self) -> bool:
        return self.state is not None

    def allowed(self) -> torch.Tensor | None:
        """The ids that may come next (bool, the vocabulary's size), or None when nothing is masked."""
        if self.state is None:
            return self.vocab.entry_mask(self.start, _trigger_written(self._tail))
        mask = self.vocab.mask(self.state)
        if not bool(mask.any()):
            self.state = None
            return None
        return mask

    def feed(self, data: bytes) -> None:
        """Take bytes the row wrote (or that its prompt ends with, such as a prefilled call opening)."""
        for k in range(len(data)):
            if self.state is None:
                self._tail = (self._tail + data[k:k + 1])[-len(TRIGGER):]
                if self._tail == TRIGGER:
                    self.state, self._tail = self.start, b""
                continue
            self.state = step(self.state, data[k:k + 1])
            if self.state == _DONE or not self.state:  # closed, or unguidable: free text again
                self.state = None

    def advance(self, token: int) -> None:
        """Take the token the row drew."""
        if 0 <= token < len(self.vocab.token_bytes):
            self.feed(self.vocab.token_bytes[token])
