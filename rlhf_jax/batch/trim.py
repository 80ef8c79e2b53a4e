"""Trim the all-padding columns of a rollout batch before the unpacked training passes.

Prompts are left-padded to P and responses right-padded to R; when the longest
response of a step has 40 tokens, the last R - 40 response columns are padding in
every row. Cutting them is exact (masked columns contribute nothing to any loss,
advantage or metric). The kept widths are rounded up to powers of two (at least
``minimum``) so a run compiles each pass for at most log2(P) x log2(R) shapes.
"""

from __future__ import annotations

import numpy as np

from rlhf_jax.rollout.buckets import next_power_of_two

MIN_TRIM_BUCKET = 16


def trimmed_width(longest: int, full: int, minimum: int = MIN_TRIM_BUCKET) -> int:
    """The bucketed width that holds ``longest`` valid columns, never more than ``full``."""
    return min(full, next_power_of_two(max(int(longest), int(minimum))))


def trim_columns(prompt_mask: np.ndarray, response_mask: np.ndarray) -> tuple[int, int]:
    """(prompt columns to keep at the right end, response columns to keep at the left end)."""
    P, R = prompt_mask.shape[1], response_mask.shape[1]
    longest_prompt = int(prompt_mask.sum(1).max(initial=1))
    longest_response = int(response_mask.sum(1).max(initial=1))
    return trimmed_width(longest_prompt, P), trimmed_width(longest_response, R)
