"""Answer match: the scorer of data that brings a reference answer but no scorer of its own.

Data sources without a registered scorer (e.g. a Q/A file, whose data_source is its file's name)
are scored by this one. Modes (``reward_model.answer_match``):

- ``exact``: the response equals the answer, ignoring case, runs of whitespace and trailing ``.!?``;
- ``numeric``: the whole response is a number equal to the answer's number;
- ``last_number``: the last number of the response equals the answer's number;
- ``any`` (default): any of the three.

The answer's number is the answer itself when it is one, else its last number (so a GSM8K-style
answer ending in ``#### 72`` means 72). Numbers compare as decimals (``72.0`` equals ``72``, ``1,234``
equals ``1234``). Score 1.0 on a match, 0.0 otherwise.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from rlhf_jax.config.names import ANSWER_MATCH_MODES
from rlhf_jax.rewards.gsm8k import extract_solution, normalize_number

MODES = ANSWER_MATCH_MODES


def _text(value: Any) -> str:
    return " ".join(str(value).split()).rstrip(".!?").strip().casefold()


def _number(text: str) -> Decimal | None:
    """``text`` as a decimal when the whole of it is one number."""
    try:
        value = Decimal(normalize_number(text.strip()))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _last_number(text: str) -> Decimal | None:
    answer = extract_solution(text, method="flexible", clip_chars=0)
    return None if answer is None else _number(answer)


def compute_score(solution_str: str, ground_truth: Any, mode: str = "any") -> float:
    if mode not in MODES:
        raise ValueError(f"reward_model.answer_match must be one of {MODES}, got {mode!r}")
    truth = str(ground_truth)
    truth_number = _number(truth)
    if truth_number is None:
        truth_number = _last_number(truth)
    matches = {
        "exact": lambda: _text(solution_str) == _text(truth),
        "numeric": lambda: truth_number is not None and _number(solution_str) == truth_number,
        "last_number": lambda: truth_number is not None and _last_number(solution_str) == truth_number,
    }
    wanted = matches.values() if mode == "any" else [matches[mode]]
    return 1.0 if any(check() for check in wanted) else 0.0
