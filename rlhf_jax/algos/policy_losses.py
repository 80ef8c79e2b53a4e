"""Policy losses (actor.policy_loss.loss_mode), registered by name.

Each loss is ``fn(*, old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c, denominator,
norm_constant, **options) -> (loss, metrics)``; metrics always hold
pg_clipfrac, pg_clipfrac_lower and ppo_kl (masked means over this batch).
``denominator`` is the mini-batch aggregation denominator (see aggregation.py)
for the *effective* aggregation mode (``effective_loss_agg_mode``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .aggregation import agg_loss, check_loss_agg_mode, masked_mean
from .registry import POLICY_LOSSES, register_policy_loss

Array = jnp.ndarray
sg = jax.lax.stop_gradient


def policy_metrics(clipfrac: Array, clipfrac_lower: Array, ppo_kl: Array) -> dict[str, Array]:
    """The metrics every policy loss reports (verl's names), as float32 scalars."""
    return {
        "pg_clipfrac": jnp.asarray(clipfrac, jnp.float32),
        "pg_clipfrac_lower": jnp.asarray(clipfrac_lower, jnp.float32),
        "ppo_kl": jnp.asarray(ppo_kl, jnp.float32),
    }


def aggregate_policy_loss(loss_mat: Array, kw: dict[str, Any]) -> Array:
    """Aggregate per-token losses; ``rollout_is_weights`` (off-policy correction) scale each token's loss first."""
    weights = kw.get("rollout_is_weights")
    if weights is not None:
        loss_mat = loss_mat * sg(weights)
    return agg_loss(loss_mat, kw["response_mask"], kw["loss_agg_mode"],
                    denominator=kw.get("denominator"), norm_constant=kw.get("norm_constant"))


@register_policy_loss("vanilla")
def vanilla(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array,
            clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
            **kw: Any) -> tuple[Array, dict[str, Array]]:
    """PPO clip with asymmetric bounds and dual clip (-A c caps the loss where A < 0)."""
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    delta = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(delta)
    l1 = -advantages * ratio
    l2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    lc = jnp.maximum(l1, l2)
    l3 = -advantages * clip_ratio_c
    neg = advantages < 0
    losses = jnp.where(neg, jnp.minimum(l3, lc), lc)
    metrics = policy_metrics(
        masked_mean((l2 > l1).astype(jnp.float32), response_mask),
        masked_mean(((lc > l3) & neg).astype(jnp.float32), response_mask),
        masked_mean(-delta, response_mask),
    )
    return aggregate_policy_loss(losses, {"response_mask": response_mask, **kw}), metrics


@register_policy_loss("gspo", agg_mode="seq-mean-token-mean")
def gspo(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array,
         clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, **kw: Any) -> tuple[Array, dict[str, Array]]:
    """Sequence-level ratio s_i = exp(mean_t delta) with per-token gradient; always seq-mean-token-mean."""
    delta = log_prob - old_log_prob
    length = jnp.maximum(jnp.sum(response_mask, axis=-1), 1.0)
    seq_delta = jnp.sum(jnp.where(response_mask > 0, delta * response_mask, 0.0), axis=-1) / length
    log_s = jnp.minimum(log_prob - sg(log_prob) + sg(seq_delta)[:, None], 10.0)
    s = jnp.exp(log_s)
    l1 = -advantages * s
    l2 = -advantages * jnp.clip(s, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = jnp.maximum(l1, l2)
    kw = {**kw, "loss_agg_mode": "seq-mean-token-mean"}
    metrics = policy_metrics(masked_mean((l2 > l1).astype(jnp.float32), response_mask), 0.0,
                       masked_mean(-delta, response_mask))
    return aggregate_policy_loss(losses, {"response_mask": response_mask, **kw}), metrics


@register_policy_loss("gpg")
def gpg(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array,
        **kw: Any) -> tuple[Array, dict[str, Array]]:
    """-log pi * A (no ratio, no clipping)."""
    losses = -log_prob * advantages
    metrics = policy_metrics(0.0, 0.0, masked_mean(old_log_prob - log_prob, response_mask))
    return aggregate_policy_loss(losses, {"response_mask": response_mask, **kw}), metrics


@register_policy_loss("cispo")
def cispo(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array,
          clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, **kw: Any) -> tuple[Array, dict[str, Array]]:
    """-sg(clip(ratio, 1 - lo, 1 + hi)) * A * log pi."""
    delta = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(delta)
    clipped = jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = -sg(clipped) * advantages * log_prob
    metrics = policy_metrics(masked_mean((ratio != clipped).astype(jnp.float32), response_mask), 0.0,
                       masked_mean(-delta, response_mask))
    return aggregate_policy_loss(losses, {"response_mask": response_mask, **kw}), metrics


def _dppo(valid_pos: Array, valid_neg: Array, old_log_prob: Array, log_prob: Array, advantages: Array,
          response_mask: Array, clip_ratio_c: float, kw: dict) -> tuple[Array, dict[str, Array]]:
    """DPPO's loss given its trust region: -A * sg(min(r, clip_ratio_c)) * log pi on the tokens inside it."""
    delta = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(delta)
    valid = sg(jnp.where(advantages > 0, valid_pos, valid_neg).astype(log_prob.dtype))
    losses = -advantages * sg(jnp.minimum(ratio, clip_ratio_c)) * log_prob * valid
    metrics = policy_metrics(masked_mean(1.0 - valid, response_mask),
                       masked_mean((ratio > clip_ratio_c).astype(log_prob.dtype) * valid, response_mask),
                       masked_mean(-delta, response_mask))
    return aggregate_policy_loss(losses, {"response_mask": response_mask, **kw}), metrics


@register_policy_loss("dppo_tv")
def dppo_tv(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array,
            clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
            **kw: Any) -> tuple[Array, dict[str, Array]]:
    """DPPO-Binary-TV: a token trains while its probability moved less than clip_ratio_high up (A > 0) or
    clip_ratio_low down (A <= 0), with the ratio as a truncated, stopped weight on -A log pi."""
    moved = jnp.exp(log_prob) - jnp.exp(old_log_prob)
    return _dppo(moved <= clip_ratio_high, moved >= -clip_ratio_low, old_log_prob, log_prob, advantages,
                 response_mask, clip_ratio_c, kw)


@register_policy_loss("dppo_kl")
def dppo_kl(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array,
            clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
            **kw: Any) -> tuple[Array, dict[str, Array]]:
    """DPPO-Binary-KL: the trust region is the KL between the Bernoulli distributions (the token or not) of the old
    and the current policy, within clip_ratio_high (A > 0) or clip_ratio_low, or the move is the safe way."""
    prob, old_prob = jnp.exp(log_prob), jnp.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1.0 - old_prob) * jnp.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return _dppo((binary_kl <= clip_ratio_high) | (prob <= old_prob), (binary_kl <= clip_ratio_low) | (prob >= old_prob),
                 old_log_prob, log_prob, advantages, response_mask, clip_ratio_c, kw)


@register_policy_loss("dro")
def dro(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array, dro_beta: float | None = None,
        **kw: Any) -> tuple[Array, dict[str, Array]]:
    """DRO: -(log pi * A - beta / 2 * (log pi - log pi_old)^2), no ratio and no clip; the configured aggregation."""
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.dro_beta must be > 0 for loss_mode=dro, got {dro_beta}")
    delta = log_prob - old_log_prob
    losses = -(log_prob * advantages - 0.5 * dro_beta * jnp.square(delta))
    return aggregate_policy_loss(losses, {"response_mask": response_mask, **kw}), policy_metrics(0.0, 0.0, masked_mean(-delta, response_mask))


@register_policy_loss("sapo", agg_mode="seq-mean-token-mean")
def sapo(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array, tau_pos: float = 1.0,
         tau_neg: float = 1.05, **kw: Any) -> tuple[Array, dict[str, Array]]:
    """SAPO: a soft gate instead of a clip, -A * sigmoid(tau (r - 1)) * 4 / tau with tau = tau_pos where A > 0 and
    tau_neg elsewhere (the gate's slope at r = 1 is 1, as the ratio's); always seq-mean-token-mean."""
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.tau_pos and tau_neg must be > 0, got {tau_pos}, "
                         f"{tau_neg}")
    delta = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    tau = jnp.where(advantages > 0, tau_pos, tau_neg)
    gates = jax.nn.sigmoid(tau * (jnp.exp(delta) - 1.0)) * (4.0 / tau)
    losses = -gates * advantages
    kw = {**kw, "loss_agg_mode": "seq-mean-token-mean"}
    metrics = policy_metrics(0.0, 0.0, masked_mean(-delta, response_mask))
    return aggregate_policy_loss(losses, {"response_mask": response_mask, **kw}), metrics


@register_policy_loss("geo_mean", agg_mode="seq-mean-token-mean")
def geo_mean(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array,
             clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, **kw: Any) -> tuple[Array, dict[str, Array]]:
    """GMPO (verl's ``geo_mean``): per sequence -A_i * exp(mean_t of the clipped log-ratio), the geometric mean of
    the token ratios, each clipped to [-lo, hi] in log space on the side the advantage's sign makes harmful.

    Aggregated as a mean over sequences (the loss of sequence i spread over its tokens, seq-mean-token-mean). verl
    takes ``torch.mean`` over the micro-batch's rows, so a row with an empty mask counts there; here it does not
    (padding rows and fully rejected sequences carry no response). Rollout-correction weights act per sequence, as
    their geometric mean.
    """
    valid = response_mask > 0
    delta = jnp.where(valid, log_prob - old_log_prob, 0.0)
    sign = jnp.sign(advantages)
    clamped = jnp.clip(delta, -clip_ratio_low, clip_ratio_high)
    kept = sign * jnp.minimum(sign * delta, sign * clamped)
    length = jnp.sum(response_mask, axis=-1) + 1e-8
    ratio = jnp.exp(jnp.sum(kept * response_mask, axis=-1) / length)
    advantage = jnp.sum(jnp.where(valid, advantages, 0.0) * response_mask, axis=-1) / length
    seq_loss = -advantage * ratio
    weights = kw.pop("rollout_is_weights", None)
    if weights is not None:
        seq_loss = seq_loss * jnp.exp(jnp.sum(jnp.log(sg(weights) + 1e-10) * response_mask, axis=-1) / length)
    losses = jnp.broadcast_to(seq_loss[:, None], log_prob.shape)
    clipped = (delta != clamped).astype(jnp.float32)
    metrics = policy_metrics(masked_mean(clipped * (advantages > 0), response_mask),
                       masked_mean(clipped * (advantages < 0), response_mask), masked_mean(-delta, response_mask))
    kw = {**kw, "loss_agg_mode": "seq-mean-token-mean"}
    return aggregate_policy_loss(losses, {"response_mask": response_mask, **kw}), metrics


def _rank_desc(priority: Array) -> Array:
    """Rank (0 = largest) of every entry of a flat array; stable on ties."""
    order = jnp.argsort(-priority, stable=True)
    return jnp.zeros(priority.shape, jnp.int32).at[order].set(jnp.arange(priority.size, dtype=jnp.int32))


@register_policy_loss("clip_cov")
def clip_cov(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array,
             clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, rng: Array | None = None,
             clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
             **kw: Any) -> tuple[Array, dict[str, Array]]:
    """PPO clip, plus: a random max(1, floor(ratio * #tokens)) of the unclipped tokens with
    lb < cov < ub get their loss (and gradient) zeroed; cov = (A - mean A)(log pi - mean sg log pi).
    Needs ``rng`` (a PRNG key) for the random choice."""
    if rng is None:
        raise ValueError("policy loss 'clip_cov' needs rng= (a jax PRNG key) to pick the clipped tokens")
    if not clip_cov_ratio > 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    valid = response_mask > 0
    delta = log_prob - old_log_prob
    ratio = jnp.exp(delta)
    l1 = -advantages * ratio
    l2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = (l2 > l1) & valid
    cov = (advantages - masked_mean(advantages, response_mask)) * sg(log_prob - masked_mean(sg(log_prob), response_mask))
    eligible = valid & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    n_clip = jnp.maximum(jnp.floor(clip_cov_ratio * jnp.sum(response_mask)), 1.0).astype(jnp.int32)
    u = jax.random.uniform(rng, advantages.shape)
    rank = _rank_desc(jnp.where(eligible, u, -1.0).reshape(-1)).reshape(advantages.shape)
    zeroed = eligible & (rank < n_clip)
    corr = jnp.where(zeroed, 0.0, 1.0).astype(l1.dtype)
    losses = jnp.maximum(l1, l2) * corr
    metrics = policy_metrics(masked_mean(zeroed.astype(jnp.float32), response_mask), 0.0, masked_mean(-delta, response_mask))
    return aggregate_policy_loss(losses, {"response_mask": response_mask, **kw}), metrics


@register_policy_loss("kl_cov")
def kl_cov(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array,
           kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 0.1, **kw: Any) -> tuple[Array, dict[str, Array]]:
    """-A ratio (no clipping), plus ppo_kl_coef |delta| on the top max(1, floor(ratio * #tokens))
    tokens by cov = (A - mean A)(log pi - mean log pi) over valid tokens. ppo_kl reports mean |delta|."""
    if not kl_cov_ratio > 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    valid = response_mask > 0
    delta = log_prob - old_log_prob
    abs_kl = jnp.abs(delta)
    ratio = jnp.exp(delta)
    l1 = -advantages * ratio
    vmask = valid.astype(jnp.float32)
    cov = sg((advantages - masked_mean(advantages, vmask)) * (log_prob - masked_mean(log_prob, vmask)))
    k = jnp.maximum(jnp.floor(jnp.sum(vmask) * kl_cov_ratio), 1.0).astype(jnp.int32)
    rank = _rank_desc(jnp.where(valid, cov, -jnp.inf).reshape(-1)).reshape(cov.shape)
    top = valid & (rank < k)
    losses = jnp.where(top, l1 + ppo_kl_coef * abs_kl, l1)
    metrics = policy_metrics(0.0, 0.0, masked_mean(abs_kl, response_mask))
    return aggregate_policy_loss(losses, {"response_mask": response_mask, **kw}), metrics


# ----------------------------------------------------------------------------- dispatch
def check_policy_loss(mode: str) -> None:
    """Validate actor.policy_loss.loss_mode without computing (for config validation)."""
    POLICY_LOSSES.check(mode)


def effective_loss_agg_mode(mode: str, loss_agg_mode: str) -> str:
    """The aggregation ``mode`` really uses (gspo forces seq-mean-token-mean); compute denominators for this one."""
    forced = POLICY_LOSSES.meta(mode).get("agg_mode")
    return forced if forced is not None else loss_agg_mode


def policy_loss(
    mode: str,
    *,
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    denominator: Array | float | None = None,
    norm_constant: float | None = None,
    **options: Any,
) -> tuple[Array, dict[str, Array]]:
    """Policy loss ``mode`` aggregated with ``loss_agg_mode`` (and the mini-batch ``denominator``).

    Options: rng, clip_cov_ratio, clip_cov_lb, clip_cov_ub (clip_cov); kl_cov_ratio, ppo_kl_coef (kl_cov);
    rollout_is_weights (N, R) (every mode: each token's loss times its weight, see ``rollout_correction``).
    """
    check_loss_agg_mode(loss_agg_mode)
    fn = POLICY_LOSSES.get(mode)
    mask = jnp.asarray(response_mask).astype(jnp.asarray(log_prob).dtype)
    return fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=loss_agg_mode,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        denominator=denominator,
        norm_constant=norm_constant,
        **options,
    )
