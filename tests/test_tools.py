"""The built-in tools and declared tools files (nanolm/infer/tools.py): the calculator's exact results and refusals
(never `eval`, bounded before it computes), the clock's format, and tools.json errors naming the file."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import pytest

from nanolm.chat import QWEN3, Message, ToolCall
from nanolm.errors import UserError
from nanolm.infer.tools import (BUILTIN_TOOLS, BUILTINS, MAX_DIGITS, Toolbox, calculator, current_time,
                                format_number, load_tools, run_builtin)


@pytest.mark.parametrize("expression, result", [
    ("12*(3+4)", "84"), ("6/3", "2"), ("7/2", "3.5"), ("1/3", "0.333333333333"), ("2**0.5", "1.41421356237"),
    ("2**10", "1024"), ("2**-1", "0.5"), ("-3 - -5", "2"), ("+4", "4"), ("7//2", "3"), ("-7//2", "-4"), ("7%3", "1"),
    ("-7 % 3", "2"), ("0.1+0.2", "0.3"), ("1e20", "1e+20"), ("10**20", "100000000000000000000"),
    ("(10**30+2)/2", "500000000000000000000000000001"), ("2.5*4", "10"), ("-0.0", "0"), ("1.5e-7", "1.5e-07"),
    ("sqrt(16)", "4"), ("sqrt(2)", "1.41421356237"), ("abs(-3.5)", "3.5"), ("round(2.5)", "2"),
    ("round(2.675, 2)", "2.67"), ("floor(-2.5)", "-3"), ("ceil(2.1)", "3"), ("pi", "3.14159265359"),
    ("2*e", "5.43656365692"), ("1_000 * 3", "3000"), ("  (1 + 2) * 3  ", "9"),
])
def test_calculator_results(expression, result):
    assert calculator({"expression": expression}) == result


@pytest.mark.parametrize("expression, error", [
    ("1/0", "division by zero"), ("5 % 0", "division by zero"), ("5 // 0.0", "division by zero"),
    ("0**-1", "division by zero"), ("2^3", "^ is not supported; write powers as **"),
    ("(-8)**(1/3)", "the result is not a real number"), ("sqrt(-1)", "sqrt of a negative number"),
    ("9**9**9", f"the result is too large (more than {MAX_DIGITS} digits)"),
    ("10**100", f"the result is too large (more than {MAX_DIGITS} digits)"),
    ("2.0**1000", f"the result is too large (more than {MAX_DIGITS} digits)"),
    ("x + 1", "unknown name 'x'; the calculator knows numbers, + - * / // % **, parentheses, sqrt, abs, round, "
              "floor, ceil, pi and e"),
    ("__import__('os').system('true')", "only these functions can be called: sqrt, abs, round, floor, ceil"),
    ("(1).__class__", "not arithmetic: the calculator knows numbers, + - * / // % **, parentheses, sqrt, abs, "
                      "round, floor, ceil, pi and e"),
    ("'a' * 3", "'a' is not a number"), ("True + 1", "True is not a number"), ("1j", "1j is not a number"),
    ("sqrt", "sqrt is a function; call it as sqrt(...)"), ("round(1, 2, 3)", "round takes 1 or 2 arguments, got 3"),
    ("sqrt(x=4)", "sqrt takes plain arguments, as sqrt(2)"),
    ("round(2.5, 0.5)", "round's second argument must be a whole number of digits from -15 to 15"),
    ("1 +", "not an arithmetic expression (invalid syntax)"),
    ("2 3", "not an arithmetic expression (invalid syntax at character 3)"),
    ("1 + )", "not an arithmetic expression (unmatched ')' at character 5)"), ("", "the expression is empty"),
    ("1" * 1001, "the expression is longer than 1000 characters"),
    ("-" * 990 + "1", "the expression is nested too deeply"),
])
def test_calculator_refusals_are_result_texts(expression, error):
    assert calculator({"expression": expression}) == "error: " + error


def test_calculator_nesting_limit_does_not_depend_on_the_recursion_limit():
    """torch.compile raises the interpreter's recursion limit for the whole process (to 2,000): the calculator
    counts its own nesting, so what it refuses stays the same."""
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)
    try:
        assert calculator({"expression": "-" * 990 + "1"}) == "error: the expression is nested too deeply"
        assert calculator({"expression": "+".join(["1"] * 499)}) == "499"  # 499 terms nest 498 deep
    finally:
        sys.setrecursionlimit(limit)


def test_calculator_arguments_are_checked():
    assert calculator({}) == "error: missing argument 'expression'"
    assert calculator({"expression": 3}) == "error: the argument 'expression' must be a string"
    assert calculator({"expression": "1", "x": 2}) == "error: unknown argument 'x'; this tool takes expression"
    assert calculator([]) == "error: the arguments must be a JSON object"


def test_huge_powers_are_refused_before_they_are_computed():
    t0 = time.perf_counter()
    for e in ("9**9**9", "2**(10**9)", "(10**99)**(10**99)", "2**2**2**2**2**2"):
        assert calculator({"expression": e}).startswith("error: the result is too large")
    assert time.perf_counter() - t0 < 0.5


def test_format_number():
    assert [format_number(x) for x in (84, -3, 2.0, 1e15 - 1, 1e15, 1 / 3, 123456.7, -0.5)] == [
        "84", "-3", "2", "999999999999999", "1e+15", "0.333333333333", "123456.7", "-0.5"]


def test_current_time_in_a_zone_and_locally():
    clock = lambda: datetime(2025, 1, 2, 7, 4, 5, 123456, tzinfo=timezone.utc)  # noqa: E731
    assert current_time({"timezone": "Asia/Shanghai"}, now=clock) == "2025-01-02T15:04:05+08:00 (Thursday, Asia/Shanghai)"
    assert current_time({"timezone": "UTC"}, now=clock) == "2025-01-02T07:04:05+00:00 (Thursday, UTC)"
    assert current_time({}, now=clock) == "2025-01-02T07:04:05+00:00 (Thursday, UTC)"
    for bad in ("Mars/Base", "../../etc/passwd", ""):
        assert current_time({"timezone": bad}, now=clock) == (
            f"error: unknown timezone {bad!r}; give an IANA name such as Asia/Shanghai, Europe/London or UTC")
    assert current_time({"tz": "UTC"}, now=clock) == "error: unknown argument 'tz'; this tool takes timezone"
    local = current_time({})  # the real clock, the machine's zone
    assert datetime.fromisoformat(local.split(" ")[0]).tzinfo is not None


def test_builtin_schemas_and_running_a_call():
    assert [t["function"]["name"] for t in BUILTIN_TOOLS] == ["calculator", "current_time"]
    calc = BUILTIN_TOOLS[0]
    assert calc["type"] == "function" and calc["function"]["parameters"]["required"] == ["expression"]
    assert list(calc["function"]["parameters"]["properties"]) == ["expression"]
    assert list(BUILTIN_TOOLS[1]["function"]["parameters"]["properties"]) == ["timezone"]
    assert BUILTINS["calculator"].schema() == calc
    assert run_builtin(ToolCall("calculator", '{"expression": "2**8"}')) == "256"
    assert run_builtin(ToolCall("calculator", '{"expression": ')) .startswith("error: the arguments are not JSON")
    # The chat format lists them as it lists any tool.
    text = QWEN3.render([Message("user", "hi")], Toolbox.from_specs(["builtin"]).texts())
    assert text.count('{"type": "function", "function": {"name": "') == 2


def test_load_tools_and_its_errors(tmp_path):
    good = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                              "parameters": {"type": "object", "properties": {}}}}]
    f = tmp_path / "tools.json"
    f.write_text(json.dumps(good))
    assert load_tools(f) == tuple(good)
    box = Toolbox.from_specs(["builtin", str(f)])
    assert box.names() == ["calculator", "current_time", "get_weather"]
    assert box.can_run(ToolCall("calculator", "{}")) and not box.can_run(ToolCall("get_weather", "{}"))

    def refused(text: str) -> str:
        f.write_text(text)
        with pytest.raises(UserError) as e:
            load_tools(f)
        return str(e.value)

    assert refused("[{") == f"{f}:1: not valid JSON (Expecting property name enclosed in double quotes); give a " \
                            "JSON array of OpenAI tool objects"
    assert refused("{}").startswith(f"{f}: expected a non-empty JSON array of tool objects")
    assert refused("[]").startswith(f"{f}: expected a non-empty JSON array of tool objects")
    assert refused('[{"type": "function"}]').startswith(f"{f}: tools[0] must be a tool object with a function name")
    assert refused('[{"name": "a b"}]') == f"{f}: tools[0] has the function name 'a b'; use 1-64 letters, digits, " \
                                           "_ or -"
    assert refused('[{"name": "a"}, {"name": "a"}]') == f"{f}: tools[1] declares 'a' a second time; give each " \
                                                        "tool once"
    with pytest.raises(UserError, match=r"no such tools file; give a JSON array of OpenAI tool objects, or "
                                        r"--tools builtin"):
        load_tools(tmp_path / "none.json")
    f.write_text(json.dumps([{"name": "calculator"}]))
    with pytest.raises(UserError, match=r"--tools: the tool 'calculator' is declared by both builtin and "):
        Toolbox.from_specs(["builtin", str(f)])
