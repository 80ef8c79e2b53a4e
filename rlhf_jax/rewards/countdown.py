"""Countdown scorer: reach a target with the given numbers and + - * /.

Ground truth: ``{"target": int, "numbers": [int, ...]}``. The answer is read from
the last ``<answer>...</answer>`` in the response (an optional trailing
``= target`` inside it is ignored). It must be a plain arithmetic expression
(checked by :mod:`rlhf_jax.rewards.expression`, never ``eval``) that uses every
given number exactly once and equals the target exactly.

Scores: ``score`` (1.0) when correct; ``format_score`` (0.1) when an
``<answer>`` block is present but the expression is invalid, reuses or omits a
number, or misses the target; 0.0 when there is no ``<answer>`` block.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from rlhf_jax.rewards.expression import UnsafeExpression, evaluate

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(solution_str: str) -> str | None:
    """The text inside the last <answer>...</answer> block, or None."""
    matches = _ANSWER.findall(solution_str)
    return matches[-1].strip() if matches else None


def _parse_ground_truth(ground_truth: Any) -> tuple[int, list[int]]:
    if not isinstance(ground_truth, dict) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(f"countdown ground truth must be {{'target': int, 'numbers': [...]}}, got {ground_truth!r}")
    return int(ground_truth["target"]), [int(n) for n in ground_truth["numbers"]]


def check_equation(expression: str, target: int, numbers: list[int]) -> bool:
    """True iff `expression` is safe, uses each of `numbers` exactly once, and equals `target`."""
    if "=" in expression:
        expression = expression.split("=")[0]
    try:
        value, used = evaluate(expression)
    except (UnsafeExpression, ZeroDivisionError):
        return False
    if Counter(used) != Counter(numbers):
        return False
    return value == target


def compute_score(
    solution_str: str, ground_truth: Any, format_score: float = 0.1, score: float = 1.0
) -> float:
    """Score one countdown response (see module docstring)."""
    target, numbers = _parse_ground_truth(ground_truth)
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    return score if check_equation(answer, target, numbers) else format_score
