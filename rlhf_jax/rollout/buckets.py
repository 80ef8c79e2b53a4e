"""Static shapes for the sampler: bucketed prompt lengths and batch sizes, and left padding.

The sampler compiles once per (batch, prompt length) shape. Rounding both up
to a small set of buckets (powers of two, batch also a multiple of the
data-parallel size) bounds the number of compilations of a run: at most
log2(max_prompt_length) length buckets times a few batch buckets.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

MIN_PROMPT_BUCKET = 16


def next_power_of_two(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def bucket_length(length: int, *, minimum: int = MIN_PROMPT_BUCKET, maximum: int | None = None) -> int:
    """Prompt-length bucket: the next power of two >= ``length`` (at least ``minimum``), capped at ``maximum``."""
    if maximum is not None and length > maximum:
        raise ValueError(
            f"prompt of {length} tokens is longer than the limit of {maximum} "
            "(data.max_prompt_length, or the model context minus rollout.response_length)"
        )
    bucket = next_power_of_two(max(int(length), int(minimum)))
    return min(bucket, maximum) if maximum is not None else bucket


def bucket_batch(batch: int, multiple: int = 1) -> int:
    """Batch bucket: the next power of two >= ``batch``, rounded up to a multiple of ``multiple``."""
    if batch < 1:
        raise ValueError(f"cannot sample for an empty batch of prompts (got {batch})")
    size = next_power_of_two(batch)
    return -(-size // multiple) * multiple


def left_pad(
    prompts: Sequence[Sequence[int]], length: int, batch: int, pad_token_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ids and mask, both int32 (batch, length).

    Rows past ``len(prompts)`` are filler: one pad token with mask 1 in the
    last column, so every row is an ordinary sequence with a real last token.
    """
    if len(prompts) > batch:
        raise ValueError(f"{len(prompts)} prompts do not fit a batch of {batch}")
    ids = np.full((batch, length), pad_token_id, np.int32)
    mask = np.zeros((batch, length), np.int32)
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {row} is empty; every prompt needs at least one token")
        if len(prompt) > length:
            raise ValueError(f"prompt {row} has {len(prompt)} tokens, more than the padded length {length}")
        ids[row, length - len(prompt):] = np.asarray(prompt, np.int32)
        mask[row, length - len(prompt):] = 1
    mask[len(prompts):, -1] = 1
    return ids, mask
