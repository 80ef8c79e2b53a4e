"""Score and advantage shaping around the estimator (ROLL's RLVR pipeline): normalising and clipping the scores,
dropping whole responses from the loss (by length or by their group's accuracy), whitening and clipping the
advantages.

Pure functions of (batch,) and (batch, length) arrays. Batch statistics are taken within each segment of
``segment_ids`` (batch,): ROLL computes them per data domain; one segment is the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .advantages import dense_group_index, group_stats
from .aggregation import safe_div

Array = jnp.ndarray

NORM_TYPES = ("batch", "group")


def _segment_mean_std(x_B: Array, seg_B: Array) -> tuple[Array, Array]:
    """Per-sample (mean, unbiased std) of ``x`` over its segment (``seg`` dense in [0, batch))."""
    _, mean, std = group_stats(x_B, seg_B)
    return mean, std


def normalize_scores(scores_B: Array, group_ids_B: Array, segment_ids_B: Array, mean: str | None,
                     std: str | None, epsilon: float = 1e-6) -> Array:
    """(s - mean) / (std + epsilon), each statistic over the sample's group or its segment ("batch"), or left out
    (None). Standard deviations are unbiased, as torch.std."""
    if mean is None and std is None:
        return scores_B
    for name, kind in (("mean", mean), ("std", std)):
        if kind is not None and kind not in NORM_TYPES:
            raise ValueError(f"score normalisation {name}={kind!r}: use batch, group or None")
    stats = {"group": group_stats(scores_B, dense_group_index(group_ids_B))[1:],
             "batch": _segment_mean_std(scores_B, dense_group_index(segment_ids_B))}
    out = scores_B - (stats[mean][0] if mean is not None else 0.0)
    if std is not None:
        out = out / (stats[std][1] + epsilon)
    return out


def clip_symmetric(x: Array, bound: float | None) -> tuple[Array, Array]:
    """(x clipped to [-bound, bound], the fraction of entries that were outside); bound None: unchanged, 0."""
    if bound is None:
        return x, jnp.zeros((), jnp.float32)
    outside = jnp.mean((jnp.abs(x) > bound).astype(jnp.float32))
    return jnp.clip(x, -bound, bound), outside


def sample_mask(lengths_B: Array, scores_B: Array, group_ids_B: Array, *, max_length: int, truncated: bool,
                difficulty: tuple[float, float] | None) -> tuple[Array, dict[str, Array]]:
    """(keep (batch,) 0/1, metrics): which responses stay in the loss.

    ``truncated``: a response of ``max_length`` tokens (it hit the limit) leaves. ``difficulty`` (low, high): a
    response leaves unless its group's mean score lies strictly between low and high (all solved or all failed
    groups teach nothing).
    """
    keep = jnp.ones_like(scores_B, dtype=jnp.float32)
    metrics = {}
    if truncated:
        by_length = (lengths_B != max_length).astype(jnp.float32)
        keep = keep * by_length
        metrics["actor/max_len_mask_ratio"] = jnp.mean(by_length)
    if difficulty is not None:
        low, high = difficulty
        _, mean, _ = group_stats(scores_B.astype(jnp.float32), dense_group_index(group_ids_B))
        by_difficulty = ((mean > low) & (mean < high)).astype(jnp.float32)
        keep = keep * by_difficulty
        metrics["actor/difficulty_mask_ratio"] = jnp.mean(by_difficulty)
    metrics["actor/final_mask_ratio"] = jnp.mean(keep)
    return keep, metrics


def whiten_by_segment(x_BxT: Array, mask_BxT: Array, segment_ids_B: Array) -> Array:
    """(x - mean) / sqrt(var + 1e-8) over each segment's masked tokens (unbiased var, as verl's and ROLL's
    masked_whiten); a segment with fewer than two tokens is left as it is (its variance is undefined)."""
    seg = dense_group_index(segment_ids_B)
    b = x_BxT.shape[0]
    m = mask_BxT.astype(x_BxT.dtype)

    def per_sample(v_B):
        return jax.ops.segment_sum(v_B, seg, num_segments=b)[seg]

    n = per_sample(jnp.sum(m, -1))
    mean = safe_div(per_sample(jnp.sum(x_BxT * m, -1)), n)
    sq = per_sample(jnp.sum(jnp.square(x_BxT - mean[:, None]) * m, -1))
    var = safe_div(sq, n - 1.0)
    white = (x_BxT - mean[:, None]) / jnp.sqrt(var + 1e-8)[:, None]
    return jnp.where((n > 1)[:, None], white, x_BxT)
