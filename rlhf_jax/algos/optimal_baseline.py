"""verl's optimal token baseline (OTB): a baseline per prompt group and per response position.

For each group, ``B_t = sum_i G_it W_it / (sum_i W_it + eps)`` over its samples, where ``G`` is the reward-to-go
and ``W_t = sum_{j <= t} w_j`` the path variance accumulated up to ``t``, ``w_j = 1 - 2 pi_j + sum_v pi_v^2``
(``pi_j`` the old policy's probability of the sampled token, ``sum_v pi_v^2`` over the vocabulary, from the
old-log-prob pass), times the squared rollout-correction weight when ``rollout_is`` is on. A group of one has no
baseline; the one longest sample of a group gets none past the second-longest sample's length
(``handle_zero_tail``). ``optimal_token_baseline`` works position by position of the response grid;
``tir_optimal_token_baseline`` (tool-integrated, multi-turn responses whose mask has holes) by the index of each
trained token within its response, counting only samples that train a token.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .advantages import require_groups
from .registry import register_adv_estimator

Array = jnp.ndarray
EPSILON = 1e-8


def _needs(name: str, old_log_probs: Array | None, sum_pi_squared: Array | None) -> None:
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError(f"advantage estimator {name!r} needs the old policy's log-probs and sum_pi_squared (N, R)")


def _returns_and_variance(rewards: Array, mask: Array, old_log_probs: Array, sum_pi_squared: Array,
                          rollout_is_weights: Array | None) -> tuple[Array, Array]:
    """(reward-to-go G, accumulated path variance W), both (N, R) on the response grid."""
    returns = jnp.flip(jnp.cumsum(jnp.flip(rewards * mask, -1), -1), -1)
    w = 1.0 - 2.0 * jnp.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * jnp.square(jax.lax.stop_gradient(rollout_is_weights))
    return returns, jnp.cumsum(w * mask, -1)


def _group_baselines(returns: Array, variance: Array, mask: Array, seg: Array, member: Array) -> Array:
    """(N, T) baselines of each sample's group at each position; 0 for a group of one member, and for the one
    longest member past the group's second-longest length."""
    n_rows = returns.shape[0]
    seg_sum = lambda x: jax.ops.segment_sum(x, seg, num_segments=n_rows)  # noqa: E731
    weight = variance * mask * member[:, None]
    b = (seg_sum(returns * weight) / (seg_sum(weight) + EPSILON))[seg]
    size = seg_sum(member.astype(jnp.float32))[seg]
    lengths = jnp.where(member, jnp.sum(mask, -1), -1.0)
    longest = jax.ops.segment_max(lengths, seg, num_segments=n_rows)[seg]
    at_longest = seg_sum(((lengths == longest) & member).astype(jnp.float32))[seg]
    second = jax.ops.segment_max(jnp.where(lengths < longest, lengths, -1.0), seg, num_segments=n_rows)[seg]
    second = jnp.maximum(second, 0.0)  # the others' longest (verl's sorted_lengths[-2]; members only)
    unique_longest = member & (lengths == longest) & (at_longest == 1) & (size >= 2)
    tail = unique_longest[:, None] & (jnp.arange(returns.shape[1])[None, :] >= second[:, None])
    return jnp.where((size[:, None] < 2) | tail, 0.0, b)


@register_adv_estimator("optimal_token_baseline", grouped=True, needs_sum_pi_squared=True)
def optimal_token_baseline(*, token_level_rewards: Array, response_mask: Array, group_ids: Array | None = None,
                           old_log_probs: Array | None = None, sum_pi_squared: Array | None = None,
                           rollout_is_weights: Array | None = None, **_: Any) -> tuple[Array, Array]:
    """G_t - B_t on the response grid; returns G."""
    _needs("optimal_token_baseline", old_log_probs, sum_pi_squared)
    seg = require_groups("optimal_token_baseline", group_ids)
    mask = response_mask
    returns, variance = _returns_and_variance(token_level_rewards, mask, old_log_probs, sum_pi_squared,
                                              rollout_is_weights)
    member = jnp.ones((mask.shape[0],), bool)
    return (returns - _group_baselines(returns, variance, mask, seg, member)) * mask, returns


def _compact(x: Array, mask: Array) -> Array:
    """Each row's values at its trained tokens, moved to the front in order (zeros after)."""
    slot = jnp.where(mask > 0, jnp.cumsum(mask > 0, -1) - 1, x.shape[1])  # out of range: dropped
    rows = jnp.arange(x.shape[0])[:, None]
    return jnp.zeros_like(x).at[rows, slot].set(jnp.where(mask > 0, x, 0.0), mode="drop")


@register_adv_estimator("tir_optimal_token_baseline", grouped=True, needs_sum_pi_squared=True)
def tir_optimal_token_baseline(*, token_level_rewards: Array, response_mask: Array, group_ids: Array | None = None,
                               old_log_probs: Array | None = None, sum_pi_squared: Array | None = None,
                               rollout_is_weights: Array | None = None, **_: Any) -> tuple[Array, Array]:
    """G - B with B indexed by each trained token's rank within its response (turns of a multi-turn response line
    up by the tokens the policy wrote, not by grid position); returns G on the grid."""
    _needs("tir_optimal_token_baseline", old_log_probs, sum_pi_squared)
    seg = require_groups("tir_optimal_token_baseline", group_ids)
    mask = response_mask
    returns, variance = _returns_and_variance(token_level_rewards, mask, old_log_probs, sum_pi_squared,
                                              rollout_is_weights)
    lengths = jnp.sum(mask, -1)
    ranks = jnp.arange(mask.shape[1])[None, :]
    packed_mask = (ranks < lengths[:, None]).astype(mask.dtype)
    packed_returns, packed_variance = _compact(returns, mask), _compact(variance, mask)
    baselines = _group_baselines(packed_returns, packed_variance, packed_mask, seg, lengths > 0)
    rank = jnp.clip(jnp.cumsum(mask > 0, -1) - 1, 0, mask.shape[1] - 1)
    advantages = (packed_returns - baselines)
    return jnp.take_along_axis(advantages, rank, axis=-1) * mask, returns
