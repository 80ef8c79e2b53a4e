"""Tools the model may call, registered by name; built-ins: ``calculator`` and ``python`` (sandboxed).

A tool is a ``Tool`` (name, description, JSON-schema parameters, a function of the arguments returning text, or
(text, reward): a tool reward, which reaches the reward function as ``extra_info["tool_rewards"]``, as verl's do).
``row_args`` names arguments the data row gives and the model does not: verl's ``extra_info.tools_kwargs.<tool>.
create_kwargs`` (the ground truth a grading tool compares with). Register one with ``register_tool(Tool(...))``;
``schema()`` gives the OpenAI-style function entry that chat templates render into the prompt. Built in:
``calculator``, ``python`` (sandboxed) and verl's GSM8K grading tool ``calc_gsm8k_reward``.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

from rlhf_jax.rewards.sandbox import Limits, run_python


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]  # -> text, or (text, tool reward)
    row_args: tuple[str, ...] = ()  # arguments from the data row's tools_kwargs.<name>.create_kwargs

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                  "parameters": self.parameters}}


_TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> Tool:
    _TOOLS[tool.name] = tool
    return tool


def get_tool(name: str) -> Tool | None:
    return _TOOLS.get(name)


def tool_names() -> tuple[str, ...]:
    return tuple(sorted(_TOOLS))


# ------------------------------------------------------------------------------------------------ calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 1000
MAX_DIGITS = 4000


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
            raise ValueError("result too large")
        return value
    raise ValueError(f"unsupported expression element {type(node).__name__}: use numbers, + - * / // % ** and ()")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses) as text."""
    if not isinstance(expression, str) or len(expression) > 1000:
        raise ValueError("expression must be a string of at most 1000 characters")
    value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return repr(value)
    return str(value)


register_tool(Tool(
    "calculator", "Evaluate an arithmetic expression exactly (integers) or in floating point.",
    {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3 / 4"}},
     "required": ["expression"]},
    calculate,
))


# ------------------------------------------------------------------------------------------------ python
def run_code(code: str, stdin: str = "") -> str:
    """Run Python in the sandbox; its stdout, then stderr and the outcome when it did not end cleanly."""
    result = run_python(code, stdin, Limits(cpu_s=5, wall_s=10, memory_mb=1024))
    if result.ok:
        return result.stdout
    return f"{result.stdout}\n[{result.status}, exit code {result.returncode}]\n{result.stderr[-2000:]}".strip()


register_tool(Tool(
    "python", "Run a Python program (no network, no files outside its directory, 5 CPU seconds); returns its output.",
    {"type": "object", "properties": {"code": {"type": "string"}, "stdin": {"type": "string"}}, "required": ["code"]},
    run_code,
))


# ------------------------------------------------------------------------------------------------ calc_gsm8k_reward
def gsm8k_reward(answer: Any = "", ground_truth: Any = None) -> tuple[str, float]:
    """verl's ``Gsm8kTool`` for one call (verl's agent loop makes an instance per call): the answer graded against
    the row's ground truth (flexible: its last number); tool reward 0 when right, -0.05 otherwise."""
    from rlhf_jax.rewards import gsm8k

    answer = str(answer)
    reward = gsm8k.compute_score(answer if answer.startswith("#### ") else "#### " + answer, ground_truth,
                                 method="flexible")
    return f"Current parsed {answer=} {reward=}", 0.0 if reward > 0 else -0.05


register_tool(Tool(
    "calc_gsm8k_reward", "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if "
    "parsed answer is incorrect or not correctly parsed)",
    {"type": "object", "properties": {"answer": {"type": "string", "description": "The model's answer to the GSM8K "
                                                 "math problem, must be a digits"}}, "required": ["answer"]},
    gsm8k_reward, row_args=("ground_truth",),
))
