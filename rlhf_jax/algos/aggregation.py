"""Masked statistics and loss aggregation with explicit mini-batch denominators.

With gradient accumulation the PyTorch frameworks normalised each micro-batch
by its own token (or sequence) count, so a mini-batch's token-mean was not the
token-mean of the mini-batch (verl issue 5625). Here every aggregation takes
an optional ``denominator``: ``None`` means "this batch is the whole
mini-batch"; otherwise the caller passes the mini-batch total (computed once
with ``loss_denominator`` over the mini-batch mask, across micro-batches and
data-parallel shards). Micro-batch losses computed that way are then SUMMED
(not averaged) by the trainer, and the sum equals the mini-batch loss exactly.
"""

from __future__ import annotations

import jax.numpy as jnp

Array = jnp.ndarray

TOKEN_MEAN = "token-mean"
SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"
LOSS_AGG_MODES = (TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM_NORM)


def check_loss_agg_mode(mode: str) -> None:
    """Raise ValueError naming the config key if ``mode`` is not a known aggregation mode."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {mode!r} (config key actor_rollout_ref.actor.loss_agg_mode); "
            f"choose one of: {', '.join(LOSS_AGG_MODES)}"
        )


def safe_div(num: Array, den: Array) -> Array:
    """num / den, and 0 where den == 0 (an empty mask contributes nothing instead of NaN)."""
    den = jnp.asarray(den, dtype=jnp.result_type(num, jnp.float32))
    ok = den != 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def masked_sum(values: Array, mask: Array, axis: int | None = None) -> Array:
    """Sum of values where mask is set; masked-out entries (even NaN/inf) are ignored."""
    return jnp.sum(jnp.where(mask > 0, values * mask, 0.0), axis=axis)


def masked_mean(values: Array, mask: Array, axis: int | None = None) -> Array:
    """Masked mean; 0 for an empty mask (verl divides by count + 1e-8, which gives the same)."""
    return safe_div(masked_sum(values, mask, axis), jnp.sum(mask, axis=axis))


def masked_var(values: Array, mask: Array, unbiased: bool = True) -> Array:
    """Masked variance over all entries; unbiased = Bessel-corrected (n/(n-1), guarded for n <= 1)."""
    mean = masked_mean(values, mask)
    var = masked_mean(jnp.square(values - mean), mask)
    if unbiased:
        n = jnp.sum(mask).astype(var.dtype)
        var = var * safe_div(n, jnp.maximum(n - 1.0, 1.0))
    return var


def masked_whiten(values: Array, mask: Array, shift_mean: bool = True) -> Array:
    """(x - masked mean) / sqrt(unbiased masked var + 1e-8), as verl whitens advantages."""
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    out = (values - mean) * jnp.reciprocal(jnp.sqrt(var + 1e-8))
    return out if shift_mean else out + mean


def loss_denominator(mask: Array, mode: str, *, norm_constant: float | None = None) -> Array:
    """The denominator ``agg_loss`` uses for ``mode`` when ``mask`` is the whole mini-batch.

    token-mean: number of masked tokens; seq-mean-*: number of sequences with at
    least one token; seq-mean-token-sum-norm: the constant (default: padded length).
    Compute it once over the mini-batch (all micro-batches and shards) and pass it
    to every micro-batch's ``agg_loss(..., denominator=...)``.
    """
    check_loss_agg_mode(mode)
    if mode == TOKEN_MEAN:
        return jnp.sum(mask).astype(jnp.float32)
    if mode in (SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_MEAN):
        return jnp.sum(jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
    c = mask.shape[-1] if norm_constant is None else norm_constant
    return jnp.asarray(c, dtype=jnp.float32)


def agg_loss(
    loss_mat: Array,
    mask: Array,
    mode: str,
    *,
    denominator: Array | float | None = None,
    norm_constant: float | None = None,
) -> Array:
    """Aggregate a (batch, length) loss matrix to a scalar, as verl's agg_loss.

    token-mean: sum(L*M) / D; seq-mean-token-sum: sum_i sum_t(L*M) / D;
    seq-mean-token-mean: sum_i [sum_t(L*M) / sum_t M] / D;
    seq-mean-token-sum-norm: sum(L*M) / D (a sum over sequences, Dr.GRPO).
    D = ``denominator`` if given (the mini-batch total), else
    ``loss_denominator(mask, mode, norm_constant=...)`` of this batch.
    Fully masked rows contribute 0 and do not count as sequences.
    """
    check_loss_agg_mode(mode)
    den = loss_denominator(mask, mode, norm_constant=norm_constant) if denominator is None else denominator
    den = jnp.asarray(den, dtype=jnp.float32)
    if mode == SEQ_MEAN_TOKEN_MEAN:
        seq = safe_div(masked_sum(loss_mat, mask, axis=-1), jnp.sum(mask, axis=-1))
        return safe_div(jnp.sum(seq), den)
    return safe_div(masked_sum(loss_mat, mask), den)
