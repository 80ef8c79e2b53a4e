"""GSM8K scorer (strict ``####`` answer or flexible last number).

Only the last ``clip_chars`` (300) characters of the response are searched, so a
long ramble cannot hide an early guess.

- strict: the last ``#### <number>``; ``$`` and ``,`` are dropped and a trailing
  ``.`` (end of sentence) is ignored, so ``#### $1,234.`` answers 1234.
- flexible: the last number anywhere in the (clipped) text.

Answer and ground truth are compared as exact decimals when both are numbers
(``72.0`` equals ``72``), else as normalised strings. Scores: ``score`` (1.0) on a
match, ``format_score`` (0.0) for a wrong answer, 0.0 when there is no answer.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_STRICT = re.compile(r"####\s*(-?\s*\$?\s*-?[0-9][0-9.,]*)")
_NUMBER = re.compile(r"-?\$?-?[0-9][0-9,]*(?:\.[0-9]+)?")


def normalize_number(text: str) -> str:
    """Drop '$', ',' and spaces and a trailing '.', and fold '$-5' / '-$5' into '-5'."""
    text = text.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    if text.startswith("--"):
        text = text[2:]
    return text


def extract_solution(solution_str: str, method: str = "strict", clip_chars: int = 300) -> str | None:
    """The normalised final answer, or None when the response has none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str[-clip_chars:] if clip_chars > 0 else solution_str
    pattern = _STRICT if method == "strict" else _NUMBER
    for candidate in reversed(pattern.findall(text)):
        answer = normalize_number(candidate)
        if answer not in ("", "-", "."):
            return answer
    return None


def answers_match(answer: str, ground_truth: Any) -> bool:
    """Exact decimal equality when both parse as numbers, else normalised string equality."""
    truth = normalize_number(str(ground_truth).strip())
    try:
        return Decimal(answer) == Decimal(truth)
    except InvalidOperation:
        return answer == truth


def compute_score(
    solution_str: str,
    ground_truth: Any,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    clip_chars: int = 300,
) -> float:
    """1.0 for the right answer, format_score for a wrong one, 0.0 for none."""
    answer = extract_solution(solution_str, method=method, clip_chars=clip_chars)
    if answer is None:
        return 0.0
    return score if answers_match(answer, ground_truth) else format_score


def compute_flexible_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0,
                           clip_chars: int = 300) -> float:
    """``compute_score`` in flexible mode: the last number of the response is the answer (after ``####`` or not)."""
    return compute_score(solution_str, ground_truth, method="flexible", format_score=format_score, score=score,
                         clip_chars=clip_chars)
