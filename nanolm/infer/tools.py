"""Tools a chat can offer the model: the built-in ones it can run, and the ones a user declares in a file.

A tool is an OpenAI function schema (name, description, JSON-schema
parameters) that the chat format lists in the system turn
(nanolm/chat/templates.py); the model calls it by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and the chat
feeds the result back as a `tool` message.

Built-in tools (`BUILTINS`; their schemas are `BUILTIN_TOOLS`, for the
chat, the server's clients and the data that teaches a model to call them):

- `calculator`, argument `expression`: arithmetic on numbers with
  `+ - * / // % **`, unary `+ -`, parentheses, the functions `sqrt`, `abs`,
  `round`, `floor`, `ceil` and the constants `pi` and `e`. The expression is
  parsed with `ast` and only those nodes are evaluated (no `eval`, no other
  name, attribute or call). Results are bounded (`MAX_DIGITS`), checked
  before a power is computed, so `9**9**9` is refused at once. The result
  text is stable, for training data: an integer as its digits (`84`, also
  for a float with an integral value below 10**15, `6/3` -> `2`), any other
  float in 12 significant digits (`format(x, ".12g")`: `0.333333333333`,
  `1e+20`); int / int that divides exactly stays exact.
- `current_time`, optional argument `timezone` (an IANA name such as
  `Asia/Shanghai`; default the machine's local zone): the date and time as
  `2025-01-02T15:04:05+08:00 (Thursday, Asia/Shanghai)`.

A tool never raises on what the model wrote: a bad call comes back as a
result text `error: ...`, so the model sees what went wrong.

`load_tools` reads a user's tools.json (a JSON array of OpenAI tool objects);
`Toolbox` is what a chat offers: the schemas, and which of them it can run.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import zoneinfo
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

from nanolm.chat import ChatError, ToolCall, tools_from_value
from nanolm.errors import UserError

MAX_EXPRESSION_CHARS = 1000
MAX_NESTING = 500  # operators and calls inside one another (a sum of 500 terms nests 500 deep)
MAX_DIGITS = 100  # a calculator result (or any step of it) has at most this many digits
_LIMIT = 10**MAX_DIGITS
_INTEGRAL_FLOAT_LIMIT = 10**15  # floats with an integral value below this print as integers
MAX_TOOL_ROUNDS = 5  # a chat lets the model continue after tool results at most this many times per user turn
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


@dataclass(frozen=True)
class Tool:
    """A built-in tool: its OpenAI function schema and `run(arguments) -> result text`."""

    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[[dict[str, Any]], str]

    def schema(self) -> dict[str, Any]:
        """The OpenAI tool object (what `tools` in a request, and the chat format, list)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class ToolError(Exception):
    """What a tool says back when it cannot answer a call (as `error: <message>`)."""


def _arguments(arguments: Any, required: Sequence[str], optional: Sequence[str] = ()) -> dict[str, str]:
    """The string arguments of a call, or ToolError naming the one that is missing, unknown or not a string."""
    if not isinstance(arguments, dict):
        raise ToolError("the arguments must be a JSON object")
    for name in arguments:
        if name not in (*required, *optional):
            raise ToolError(f"unknown argument {name!r}; this tool takes {', '.join((*required, *optional))}")
    for name in required:
        if name not in arguments:
            raise ToolError(f"missing argument {name!r}")
    for name, value in arguments.items():
        if not isinstance(value, str):
            raise ToolError(f"the argument {name!r} must be a string")
    return arguments


# --- calculator ----------------------------------------------------------------------------------

Number = int | float

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}
_KNOWN = "numbers, + - * / // % **, parentheses, sqrt, abs, round, floor, ceil, pi and e"
_NOT_PYTHON = {ast.BitXor: "^ is not supported; write powers as **", ast.BitAnd: "& is not supported",
               ast.BitOr: "| is not supported", ast.LShift: "<< is not supported", ast.RShift: ">> is not supported",
               ast.MatMult: "@ is not supported"}


def _checked(x: Number) -> Number:
    """x, or ToolError when it is too large or not a real number."""
    if isinstance(x, complex):
        raise ToolError("the result is not a real number")
    if isinstance(x, float) and not math.isfinite(x):
        raise ToolError("the result is too large" if math.isinf(x) else "the result is not a number")
    if abs(x) >= _LIMIT:
        raise ToolError(f"the result is too large (more than {MAX_DIGITS} digits)")
    return x


def _power(base: Number, exp: Number) -> Number:
    # Refused by its size before it is computed: 9**9**9 would take minutes and gigabytes.
    if base not in (0, 1, -1) and exp > 0 and exp * math.log10(abs(base)) >= MAX_DIGITS:
        raise ToolError(f"the result is too large (more than {MAX_DIGITS} digits)")
    if base == 0 and exp < 0:
        raise ToolError("division by zero")
    return base ** exp


def _divide(a: Number, b: Number) -> Number:
    if b == 0:
        raise ToolError("division by zero")
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b  # exact, also past a float's 53 bits
    return a / b


def _sqrt(x: Number) -> Number:
    if x < 0:
        raise ToolError("sqrt of a negative number")
    if isinstance(x, int):
        r = math.isqrt(x)
        if r * r == x:
            return r
    return math.sqrt(x)


def _round(x: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int) or abs(ndigits) > 15:
        raise ToolError("round's second argument must be a whole number of digits from -15 to 15")
    return round(x, ndigits)


def _integral(fn: Callable[[float], int]) -> Callable[[Number], Number]:
    return lambda x: x if isinstance(x, int) else fn(x)


_FUNCTIONS: dict[str, tuple[Callable[..., Number], tuple[int, int]]] = {  # name -> (function, (min, max) args)
    "sqrt": (_sqrt, (1, 1)), "abs": (abs, (1, 1)), "round": (_round, (1, 2)),
    "floor": (_integral(math.floor), (1, 1)), "ceil": (_integral(math.ceil), (1, 1)),
}


def _eval(node: ast.AST, depth: int = 0) -> Number:
    if depth > MAX_NESTING:  # counted, not left to the interpreter's recursion limit (torch.compile raises it)
        raise ToolError("the expression is nested too deeply")
    if isinstance(node, ast.Expression):
        return _eval(node.body, depth + 1)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ToolError(f"{node.value!r} is not a number")
        return _checked(node.value)
    if isinstance(node, ast.BinOp):
        op = type(node.op)
        if op not in _BINARY:
            raise ToolError(_NOT_PYTHON.get(op, "unsupported operator"))
        a, b = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if op is ast.Pow:
            return _checked(_power(a, b))
        if op is ast.Div:
            return _checked(_divide(a, b))
        if op in (ast.FloorDiv, ast.Mod) and b == 0:
            raise ToolError("division by zero")
        return _checked(_BINARY[op](a, b))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, depth + 1))
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        if node.id in _FUNCTIONS:
            raise ToolError(f"{node.id} is a function; call it as {node.id}(...)")
        raise ToolError(f"unknown name {node.id!r}; the calculator knows {_KNOWN}")
    if isinstance(node, ast.Call):
        fn = node.func.id if isinstance(node.func, ast.Name) else None
        if fn not in _FUNCTIONS:
            raise ToolError(f"only these functions can be called: {', '.join(_FUNCTIONS)}")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise ToolError(f"{fn} takes plain arguments, as {fn}(2)")
        impl, (lo, hi) = _FUNCTIONS[fn]
        if not lo <= len(node.args) <= hi:
            want = str(lo) if lo == hi else f"{lo} or {hi}"
            raise ToolError(f"{fn} takes {want} argument{'s' if hi > 1 else ''}, got {len(node.args)}")
        return _checked(impl(*(_eval(a, depth + 1) for a in node.args)))
    raise ToolError(f"not arithmetic: the calculator knows {_KNOWN}")


def format_number(x: Number) -> str:
    """The calculator's text of a result: an integer's digits; a float with an integral value below 10**15 as
    that integer; any other float in 12 significant digits (`format(x, ".12g")`)."""
    if isinstance(x, int):
        return str(x)
    if x.is_integer() and abs(x) < _INTEGRAL_FLOAT_LIMIT:
        return str(int(x))
    return format(x, ".12g")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression (see the module doc); ToolError when it is not one or is too large."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    if not expression.strip():
        raise ToolError("the expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        where = f" at character {e.offset}" if e.offset else ""
        raise ToolError(f"not an arithmetic expression ({e.msg}{where})") from None
    except (RecursionError, MemoryError):
        raise ToolError("the expression is nested too deeply") from None
    except ValueError as e:  # a NUL character
        raise ToolError(f"not an arithmetic expression ({e})") from None
    try:
        return _eval(tree)
    except RecursionError:
        raise ToolError("the expression is nested too deeply") from None
    except OverflowError:
        raise ToolError("the result is too large") from None
    except ValueError as e:  # math domain errors
        raise ToolError(str(e)) from None


def calculator(arguments: dict[str, Any]) -> str:
    """`calculator`'s result for arguments {"expression": "..."}: the number's text, or `error: ...`."""
    try:
        return format_number(evaluate(_arguments(arguments, ("expression",))["expression"]))
    except ToolError as e:
        return f"error: {e}"


# --- current_time --------------------------------------------------------------------------------

def _local_now() -> datetime:
    return datetime.now().astimezone()


def current_time(arguments: dict[str, Any], now: Callable[[], datetime] = _local_now) -> str:
    """`current_time`'s result: ISO 8601 date and time with its offset, then (weekday, zone); `error: ...` for a
    timezone that is not an IANA name. now: the clock (the local time, aware)."""
    try:
        zone = _arguments(arguments, (), ("timezone",)).get("timezone")
        t = now()
        if zone is None:
            label = t.tzname() or "local time"
        else:
            try:
                t, label = t.astimezone(zoneinfo.ZoneInfo(zone)), zone
            except (zoneinfo.ZoneInfoNotFoundError, ValueError):
                raise ToolError(f"unknown timezone {zone!r}; give an IANA name such as Asia/Shanghai, "
                                "Europe/London or UTC") from None
    except ToolError as e:
        return f"error: {e}"
    return f"{t.replace(microsecond=0).isoformat()} ({t:%A}, {label})"


# Compact descriptions: a chat offering the tools lists them in every prompt, and a small model trained on
# the built-in tool-use set attends to them in every step without being trained on them.
CALCULATOR = Tool(
    "calculator", "Evaluate an arithmetic expression.",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    calculator)
CURRENT_TIME = Tool(
    "current_time", "The date and time now.",
    {"type": "object", "properties": {"timezone": {"type": "string", "description": "IANA name; default local"}},
     "required": []},
    current_time)

BUILTINS: dict[str, Tool] = {t.name: t for t in (CALCULATOR, CURRENT_TIME)}
BUILTIN_TOOLS: tuple[dict[str, Any], ...] = tuple(t.schema() for t in BUILTINS.values())


def run_builtin(call: ToolCall) -> str:
    """The result text of a call to a built-in tool (`error: ...` when it cannot be answered); KeyError when
    the name is not a built-in."""
    tool = BUILTINS[call.name]
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError as e:
        return f"error: the arguments are not JSON ({e.msg})"
    return tool.run(arguments)


# --- declared tools ------------------------------------------------------------------------------

def tool_name(tool: Any) -> str:
    """The function name of an OpenAI tool object (or a bare function object)."""
    return tool.get("function", tool)["name"]


def load_tools(path: str | Path) -> tuple[dict[str, Any], ...]:
    """The tools of a tools.json file: a JSON array of OpenAI tool objects
    (`{"type": "function", "function": {"name", "description", "parameters"}}`). UserError naming the file and
    what is wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such tools file; give a JSON array of OpenAI tool objects, or "
                        "--tools builtin") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read it ({e}); give a UTF-8 JSON file") from None
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); give a JSON array of OpenAI tool "
                        "objects") from None
    if not isinstance(tools, list) or not tools:
        raise UserError(f"{path}: expected a non-empty JSON array of tool objects, such as "
                        '[{"type": "function", "function": {"name": "add", "parameters": {...}}}]')
    try:
        tools_from_value("tools", tools)
    except ChatError as e:
        raise UserError(f"{path}: {e}") from None
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool_name(tool)
        if not NAME_RE.fullmatch(name):
            raise UserError(f"{path}: tools[{i}] has the function name {name[:40]!r}; use 1-64 letters, digits, "
                            "_ or -")
        if name in seen:
            raise UserError(f"{path}: tools[{i}] declares {name!r} a second time; give each tool once")
        seen.add(name)
    return tuple(tools)


@dataclass
class Toolbox:
    """The tools a chat offers (OpenAI tool objects, in order) and the built-ins among them it runs itself."""

    tools: tuple[dict[str, Any], ...] = ()
    runnable: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_specs(cls, specs: Sequence[str]) -> "Toolbox":
        """From `--tools` values: `builtin` (the built-in tools, which the chat runs) or a tools.json path
        (declared tools: the chat asks the user for their results)."""
        tools: list[dict[str, Any]] = []
        runnable: set[str] = set()
        origin: dict[str, str] = {}
        for spec in specs:
            if spec == "builtin":
                given, source = BUILTIN_TOOLS, "builtin"
                runnable.update(BUILTINS)
            else:
                given, source = load_tools(spec), spec
            for tool in given:
                name = tool_name(tool)
                if name in origin:
                    raise UserError(f"--tools: the tool {name!r} is declared by both {origin[name]} and {source}; "
                                    "give each tool once")
                origin[name] = source
                tools.append(tool)
        return cls(tuple(tools), frozenset(runnable))

    def texts(self) -> tuple[str, ...]:
        """The tools as the chat format lists them (each one's JSON text)."""
        return tools_from_value("tools", list(self.tools))

    def names(self) -> list[str]:
        return [tool_name(t) for t in self.tools]

    def can_run(self, call: ToolCall) -> bool:
        return call.name in self.runnable

    def run(self, call: ToolCall) -> str:
        """A built-in call's result text."""
        return run_builtin(call)
