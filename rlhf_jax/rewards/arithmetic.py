"""Arithmetic scorer with partial credit for a well-formed answer.

Where the answer is read from, exactly:

1. If the response contains ``####``, the answer region is the text after the
   LAST ``####``; otherwise it is the whole response.
2. Surrounding whitespace and one trailing ``.`` are removed from the region.
3. The region is well-formed iff what remains is an integer literal: an optional
   ``-`` or ``+`` and digits, with optional ``,`` thousands separators
   (``-1,234``). Anything else (words, a second number, an empty region) is not
   an answer.

Scores: ``score`` (1.0) when the integer equals the ground truth; ``format_score``
(configurable, default 0.1) for a well-formed but wrong integer; 0.0 otherwise.
So a bare ``"19"`` and ``"... #### 19"`` both answer 19, while ``"19 apples"``
scores 0.
"""

from __future__ import annotations

import re
from typing import Any

_INTEGER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)")


def extract_answer(solution_str: str) -> int | None:
    """The integer answer per the module docstring's rules, or None when not well-formed."""
    region = solution_str.rsplit("####", 1)[-1].strip()
    if region.endswith("."):
        region = region[:-1].rstrip()
    if not _INTEGER.fullmatch(region):
        return None
    return int(region.replace(",", ""))


def compute_score(
    solution_str: str, ground_truth: Any, format_score: float = 0.1, score: float = 1.0
) -> float:
    """1.0 exact / format_score well-formed but wrong / 0.0 no answer."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    try:
        truth = int(str(ground_truth).strip().replace(",", ""))
    except ValueError:
        raise ValueError(f"arithmetic ground truth must be an integer, got {ground_truth!r}") from None
    return score if answer == truth else format_score
