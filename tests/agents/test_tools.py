"""Tool calls: parsing, the built-in tools, and the executor's handling of every fault (real threads, real sandbox)."""

import json
import random
import time

import pytest

from rlhf_jax.agents import Tool, ToolCall, ToolStats, parse_tool_calls, run_tool_calls, tool_message
from rlhf_jax.agents.tools import calculate


def _call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_hermes_calls_are_parsed_and_bad_blocks_reported():
    text = ("Let me compute. " + _call("calculator", expression="1+2") + "\nand\n"
            + '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            + "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
            + '<tool_call>{"name": "calculator", "arguments": {"expression": "3"}}')  # cut at the stop token
    parsed = parse_tool_calls(text)
    assert parsed.calls == (ToolCall("calculator", {"expression": "1+2"}), ToolCall("python", {"code": "print(1)"}),
                            ToolCall("calculator", {"expression": "3"}))
    assert len(parsed.errors) == 2 and all("malformed tool call" in e for e in parsed.errors)
    assert parse_tool_calls("no calls here") == parse_tool_calls("")
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'"):
        parse_tool_calls(text, parser="xml")


def test_calculator_matches_python_arithmetic_on_random_expressions():
    rng = random.Random(0)
    for _ in range(200):
        a, b, c = rng.randint(-999, 999), rng.randint(1, 99), rng.randint(0, 9)
        op1, op2 = rng.choice("+-*"), rng.choice(["+", "-", "*", "//", "%"])
        expr = f"({a} {op1} {b}) {op2} {c or 1} ** 2"
        assert calculate(expr) == str(eval(expr)), expr  # noqa: S307 - the reference
    assert calculate("7 / 2") == "3.5" and calculate("10 / 4 * 2") == "5"
    for bad, message in (("__import__('os')", "unsupported"), ("1 / 0", "division by zero"), ("2 ** 100000", "exponent"),
                         ("x + 1", "unsupported")):
        with pytest.raises((ValueError, ZeroDivisionError), match=message):
            calculate(bad)


def test_every_fault_comes_back_as_an_error_and_is_counted():
    def slow(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    def broken() -> str:
        raise RuntimeError("disk on fire")

    tools = {"slow": Tool("slow", "sleeps", {}, slow), "broken": Tool("broken", "raises", {}, broken),
             "calculator": Tool("calculator", "", {}, calculate)}
    calls = [ToolCall("calculator", {"expression": "6*7"}), ToolCall("nope", {}), ToolCall("broken", {}),
             ToolCall("slow", {"seconds": 30}), ToolCall("calculator", {"wrong_argument": 1})]
    start = time.monotonic()
    results = run_tool_calls(calls, timeout_s=0.5, tools=tools)
    assert time.monotonic() - start < 2.0  # the hanging tool does not hold the trajectory
    assert results[0].content == "42" and results[0].error is None
    assert results[1].error == "unknown tool 'nope'" and results[1].content.startswith("Error:")
    assert "disk on fire" in results[2].error
    assert results[3].timed_out and "timed out after 0.5 s" in results[3].content
    assert "TypeError" in results[4].error
    stats = ToolStats()
    stats.add(results, parse_errors=1)
    assert (stats.calls, stats.errors, stats.timeouts) == (6, 5, 1)
    assert tool_message(results[0]) == {"role": "tool", "name": "calculator", "content": "42"}


def test_calls_run_at_the_same_time():
    tools = {"wait": Tool("wait", "", {}, lambda: (time.sleep(0.4), "ok")[1])}
    start = time.monotonic()
    results = run_tool_calls([ToolCall("wait", {})] * 5, timeout_s=5, tools=tools)
    assert [r.content for r in results] == ["ok"] * 5 and time.monotonic() - start < 1.5


def test_the_python_tool_runs_in_the_sandbox():
    ok, escape = run_tool_calls([ToolCall("python", {"code": "print(sum(range(10)))"}),
                                 ToolCall("python", {"code": "import os\nos.system('echo hi')"})], timeout_s=20)
    assert ok.content.strip() == "45"
    assert ok.error is None and "os.system is not allowed" in escape.content


def test_a_tool_takes_the_rows_arguments_over_the_models_and_may_return_a_reward():
    """verl's tools_kwargs: the row's create_kwargs reach the tool (the model cannot supply them), and a tool's
    (text, reward) gives the call a reward."""
    def check(guess, secret):
        return f"{guess}/{secret}", float(guess == secret)

    tools = {"check": Tool("check", "", {"type": "object"}, check, row_args=("secret",))}
    calls = [ToolCall("check", {"guess": 3, "secret": 3}), ToolCall("check", {"guess": 5})]
    results = run_tool_calls(calls, tools=tools, row_kwargs={"check": {"create_kwargs": {"secret": 5}}})
    assert [(r.content, r.reward) for r in results] == [("3/5", 0.0), ("5/5", 1.0)]
    missing = run_tool_calls(calls[1:], tools=tools)  # no row arguments: the call's error, as any other
    assert missing[0].error and "secret" in missing[0].error and missing[0].reward is None


def test_calc_gsm8k_reward_answers_as_verls_gsm8k_tool():
    from rlhf_jax.agents.tools import get_tool

    tool = get_tool("calc_gsm8k_reward")
    assert tool.row_args == ("ground_truth",) and tool.schema()["function"]["parameters"]["required"] == ["answer"]
    row = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
    right, wrong, text = run_tool_calls([ToolCall("calc_gsm8k_reward", {"answer": "72"}),
                                         ToolCall("calc_gsm8k_reward", {"answer": "#### 70"}),
                                         ToolCall("calc_gsm8k_reward", {"answer": "it is 72"})], row_kwargs=row)
    assert (right.content, right.reward) == ("Current parsed answer='72' reward=1.0", 0.0)
    assert (wrong.content, wrong.reward) == ("Current parsed answer='#### 70' reward=0.0", -0.05)
    assert text.content.endswith("reward=1.0")  # flexible: the last number
