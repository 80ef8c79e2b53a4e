"""Clipped PPO value loss (critic)."""

from __future__ import annotations

import jax.numpy as jnp

from .aggregation import agg_loss, masked_mean

Array = jnp.ndarray


def value_loss(
    vpreds: Array,
    values: Array,
    returns: Array,
    response_mask: Array,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    *,
    denominator: Array | float | None = None,
    norm_constant: float | None = None,
) -> tuple[Array, Array]:
    """0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)) and vf_clipfrac.

    vf_clipfrac = masked mean of [(v_clipped - R)^2 > (v - R)^2]. ``denominator`` is the
    mini-batch aggregation denominator (see aggregation.loss_denominator).
    """
    mask = jnp.asarray(response_mask).astype(jnp.asarray(vpreds).dtype)
    v_clipped = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    l1 = jnp.square(vpreds - returns)
    l2 = jnp.square(v_clipped - returns)
    loss = 0.5 * agg_loss(jnp.maximum(l1, l2), mask, loss_agg_mode, denominator=denominator,
                          norm_constant=norm_constant)
    clipfrac = masked_mean((l2 > l1).astype(jnp.float32), mask)
    return loss, clipfrac
