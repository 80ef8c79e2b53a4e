"""Advantage estimators (algorithm.adv_estimator), registered by name.

Every estimator is a pure function of (batch, length) arrays and returns
``(advantages, returns)``. Group membership is an integer array of group ids
(samples of one prompt share an id); groups need not be contiguous and may have
different sizes. Group statistics are segment sums over ids remapped to
[0, batch) with static ``num_segments = batch``, so everything jits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .aggregation import masked_whiten, safe_div
from .registry import ADV_ESTIMATORS, register_adv_estimator

Array = jnp.ndarray


# ----------------------------------------------------------------------------- group helpers
def dense_group_index(group_ids: Array) -> Array:
    """Map arbitrary integer group ids (batch,) to dense segment ids in [0, batch)."""
    b = group_ids.shape[0]
    _, inv = jnp.unique(group_ids, size=b, fill_value=jnp.max(group_ids), return_inverse=True)
    return inv.reshape(b)


def _group_sum(x: Array, seg: Array) -> Array:
    """Per-sample sum of x over the sample's group, shape (batch,)."""
    return jax.ops.segment_sum(x, seg, num_segments=x.shape[0])[seg]


def group_stats(scores: Array, seg: Array) -> tuple[Array, Array, Array]:
    """Per-sample (group size, group mean, unbiased group std); std is 0 for groups of one."""
    n = _group_sum(jnp.ones_like(scores), seg)
    mean = _group_sum(scores, seg) / n
    sq = _group_sum(jnp.square(scores - mean), seg)
    std = jnp.sqrt(safe_div(sq, n - 1.0))
    return n, mean, std


def require_groups(name: str, group_ids: Array | None) -> Array:
    """Dense group indices of ``group_ids`` for estimator ``name``, which compares samples of one prompt."""
    if group_ids is None:
        raise ValueError(f"advantage estimator {name!r} needs group_ids (batch,): samples of one prompt share an id")
    return dense_group_index(jnp.asarray(group_ids))


def _scores(token_level_rewards: Array) -> Array:
    return jnp.sum(token_level_rewards, axis=-1)


# ----------------------------------------------------------------------------- estimators
@register_adv_estimator("gae", needs_critic=True)
def gae(*, token_level_rewards: Array, response_mask: Array, values: Array | None = None,
        gamma: float = 1.0, lam: float = 1.0, **_: Any) -> tuple[Array, Array]:
    """GAE; the recursion only advances on response tokens (M=1), then advantages are masked-whitened."""
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values (batch, length) from the critic")
    r = token_level_rewards.T
    v = values.T.astype(r.dtype)
    m = response_mask.T.astype(r.dtype)

    def step(carry, xs):
        next_v, last = carry
        r_t, v_t, m_t = xs
        delta = r_t + gamma * next_v - v_t
        cand = delta + gamma * lam * last
        next_v = v_t * m_t + (1.0 - m_t) * next_v
        last = cand * m_t + (1.0 - m_t) * last
        return (next_v, last), last

    zeros = jnp.zeros_like(r[0])
    _, adv = jax.lax.scan(step, (zeros, zeros), (r, v, m), reverse=True)
    adv = adv.T
    returns = adv + values
    return masked_whiten(adv, response_mask), returns


@register_adv_estimator("grpo", grouped=True)
def grpo(*, token_level_rewards: Array, response_mask: Array, group_ids: Array | None = None,
         norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6, **_: Any) -> tuple[Array, Array]:
    """(s - mean_g) / (std_g + eps); a group of one uses mean 0, std 1. Without std: Dr.GRPO."""
    seg = require_groups("grpo", group_ids)
    s = _scores(token_level_rewards)
    n, mean, std = group_stats(s, seg)
    single = n <= 1
    mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, std)
    a = (s - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else s - mean
    adv = a[:, None] * response_mask
    return adv, adv


@register_adv_estimator("rloo", grouped=True)
def rloo(*, token_level_rewards: Array, response_mask: Array, group_ids: Array | None = None,
         **_: Any) -> tuple[Array, Array]:
    """s_i - mean of the other samples of the group = (n s_i - sum_g) / (n - 1); n = 1 keeps s_i."""
    seg = require_groups("rloo", group_ids)
    s = _scores(token_level_rewards)
    n = _group_sum(jnp.ones_like(s), seg)
    total = _group_sum(s, seg)
    a = jnp.where(n > 1, (n * s - total) / jnp.maximum(n - 1.0, 1.0), s)
    adv = a[:, None] * response_mask
    return adv, adv


@register_adv_estimator("grpo_vectorized", grouped=True)
def grpo_vectorized(**kwargs: Any) -> tuple[Array, Array]:
    """verl's vectorised GRPO: its group statistics (mean 0 and std 1 for a group of one, the unbiased std) are
    GRPO's, so it is GRPO; the name lets verl's scripts run unchanged."""
    return grpo(**kwargs)


@register_adv_estimator("rloo_vectorized", grouped=True)
def rloo_vectorized(*, token_level_rewards: Array, response_mask: Array, group_ids: Array | None = None,
                    **_: Any) -> tuple[Array, Array]:
    """verl's vectorised RLOO: RLOO, except that a group of one gets advantage 0 (``rloo`` keeps its score)."""
    seg = require_groups("rloo_vectorized", group_ids)
    s = _scores(token_level_rewards)
    n = _group_sum(jnp.ones_like(s), seg)
    a = jnp.where(n > 1, (n * s - _group_sum(s, seg)) / jnp.maximum(n - 1.0, 1.0), 0.0)
    adv = a[:, None] * response_mask
    return adv, adv


@register_adv_estimator("gdpo", grouped=True)
def gdpo(*, token_level_rewards: Array, response_mask: Array, group_ids: Array | None = None,
         reward_components: Array | None = None, reward_weights: tuple[float, ...] | None = None,
         norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6, **_: Any) -> tuple[Array, Array]:
    """GDPO (verl's compute_gdpo_outcome_advantage): each reward component (``reward_components`` (N, K), the
    reward function's ``algorithm.gdpo_reward_keys``) is normalised within its group as GRPO does, the components
    are summed with ``reward_weights`` (default 1 each), and the sum is whitened over the batch's response tokens.
    Without components the summed token reward is the one component."""
    comps = _scores(token_level_rewards)[:, None] if reward_components is None else jnp.asarray(reward_components)
    weights = (1.0,) * comps.shape[1] if reward_weights is None else tuple(reward_weights)
    total = jnp.zeros_like(response_mask)
    for k, w in enumerate(weights):
        a_k, _ = grpo(token_level_rewards=comps[:, k:k + 1].astype(response_mask.dtype), response_mask=response_mask,
                      group_ids=group_ids, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, epsilon=epsilon)
        total = total + w * a_k
    adv = masked_whiten(total, response_mask) * response_mask
    return adv, adv


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus(*, token_level_rewards: Array, response_mask: Array, gamma: float = 1.0,
                        **_: Any) -> tuple[Array, Array]:
    """Discounted return G_t = r_t + gamma G_{t+1} (reset after the response), whitened over tokens."""
    r = token_level_rewards.T
    m = response_mask.T.astype(r.dtype)

    def step(running, xs):
        r_t, m_t = xs
        g = r_t + gamma * running
        return g * m_t, g

    _, ret = jax.lax.scan(step, jnp.zeros_like(r[0]), (r, m), reverse=True)
    returns = ret.T
    adv = masked_whiten(returns, response_mask) * response_mask
    return adv, returns


@register_adv_estimator("reinforce")
def reinforce(*, token_level_rewards: Array, response_mask: Array, gamma: float = 1.0,
              **_: Any) -> tuple[Array, Array]:
    """ROLL's reinforce: the discounted return G_t = r_t + gamma G_{t+1} of the masked token rewards, no baseline
    (normalise the scores for one: algorithm.reward_norm.*), masked."""
    r = (token_level_rewards * response_mask).T

    def step(running, r_t):
        g = r_t + gamma * running
        return g, g

    _, ret = jax.lax.scan(step, jnp.zeros_like(r[0]), r, reverse=True)
    returns = ret.T * response_mask
    return returns, returns


@register_adv_estimator("reinforce_plus_plus_baseline", grouped=True)
def reinforce_plus_plus_baseline(*, token_level_rewards: Array, response_mask: Array,
                                 group_ids: Array | None = None, **_: Any) -> tuple[Array, Array]:
    """(s - group mean) broadcast over tokens, whitened over the batch's response tokens."""
    seg = require_groups("reinforce_plus_plus_baseline", group_ids)
    s = _scores(token_level_rewards)
    n, mean, _ = group_stats(s, seg)
    a = s - jnp.where(n <= 1, 0.0, mean)
    tiled = a[:, None] * response_mask
    adv = masked_whiten(tiled, response_mask) * response_mask
    return adv, adv


@register_adv_estimator("remax", needs_greedy_baseline=True)
def remax(*, token_level_rewards: Array, response_mask: Array, reward_baselines: Array | None = None,
          **_: Any) -> tuple[Array, Array]:
    """Reward-to-go minus the greedy rollout's score b (option reward_baselines, (batch,))."""
    if reward_baselines is None:
        raise ValueError("advantage estimator 'remax' needs reward_baselines (batch,): the greedy rollout's score")
    rm = token_level_rewards * response_mask
    returns = jnp.flip(jnp.cumsum(jnp.flip(rm, -1), axis=-1), -1)
    adv = returns - jnp.asarray(reward_baselines)[:, None] * response_mask
    return adv, returns


@register_adv_estimator("opo", grouped=True)
def opo(*, token_level_rewards: Array, response_mask: Array, group_ids: Array | None = None,
        **_: Any) -> tuple[Array, Array]:
    """s_i - length-weighted group mean sum(|y| s) / sum(|y|); a group of one has baseline 0."""
    seg = require_groups("opo", group_ids)
    s = _scores(token_level_rewards)
    length = jnp.sum(response_mask, axis=-1).astype(s.dtype)
    n = _group_sum(jnp.ones_like(s), seg)
    base = safe_div(_group_sum(length * s, seg), _group_sum(length, seg))
    a = s - jnp.where(n <= 1, 0.0, base)
    adv = a[:, None] * response_mask
    return adv, adv


@register_adv_estimator("gpg", grouped=True)
def gpg(*, token_level_rewards: Array, response_mask: Array, group_ids: Array | None = None,
        f_norm: float = 1.0, **_: Any) -> tuple[Array, Array]:
    """alpha (s - group mean) / f_norm with alpha = batch / max(1, #nonzero scores)."""
    seg = require_groups("gpg", group_ids)
    s = _scores(token_level_rewards)
    b = s.shape[0]
    alpha = b / jnp.maximum(jnp.count_nonzero(s), 1).astype(s.dtype)
    n, mean, _ = group_stats(s, seg)
    a = alpha * (s - jnp.where(n <= 1, 0.0, mean)) / f_norm
    adv = a[:, None] * response_mask
    return adv, adv


@register_adv_estimator("grpo_passk", grouped=True)
def grpo_passk(*, token_level_rewards: Array, response_mask: Array, group_ids: Array | None = None,
               norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6, **_: Any) -> tuple[Array, Array]:
    """Only the best sample of each group gets r_max - r_second (divided by std_g + eps if normalising).

    Needs groups of at least 2 samples; a group of one (which verl rejects) gets advantage 0.
    Ties for the best go to the lowest batch index (the value is then 0 anyway).
    """
    seg = require_groups("grpo_passk", group_ids)
    s = _scores(token_level_rewards)
    b = s.shape[0]
    idx = jnp.arange(b)
    gmax = jax.ops.segment_max(s, seg, num_segments=b)[seg]
    first = jax.ops.segment_min(jnp.where(s == gmax, idx, b), seg, num_segments=b)[seg]
    is_best = idx == first
    second = jax.ops.segment_max(jnp.where(is_best, -jnp.inf, s), seg, num_segments=b)[seg]
    n, _, std = group_stats(s, seg)
    gap = gmax - jnp.where(n >= 2, second, gmax)
    if norm_adv_by_std_in_grpo:
        gap = gap / (std + epsilon)
    a = jnp.where(is_best, gap, 0.0)
    adv = a[:, None] * response_mask
    return adv, adv


# ----------------------------------------------------------------------------- dispatch
def check_adv_estimator(name: str) -> None:
    """Validate algorithm.adv_estimator without computing (for config validation)."""
    ADV_ESTIMATORS.check(name)


def compute_advantages(
    name: str,
    *,
    token_level_rewards: Array,
    response_mask: Array,
    group_ids: Array | None = None,
    values: Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **options: Any,
) -> tuple[Array, Array]:
    """Run the estimator registered as ``name``; returns (advantages, returns), both (batch, length).

    Options are forwarded (norm_adv_by_std_in_grpo, epsilon, reward_baselines, f_norm, ...);
    an estimator ignores options it does not use, so one option set serves every estimator.
    """
    fn = ADV_ESTIMATORS.get(name)
    mask = jnp.asarray(response_mask).astype(jnp.asarray(token_level_rewards).dtype)
    return fn(
        token_level_rewards=jnp.asarray(token_level_rewards),
        response_mask=mask,
        group_ids=group_ids,
        values=values,
        gamma=gamma,
        lam=lam,
        **options,
    )
