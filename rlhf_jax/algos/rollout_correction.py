"""Off-policy correction between the sampler's log-probs and the trainer's (verl's rollout correction).

The sampler's log-probs are the behaviour policy; the trainer recomputes the
same tokens' log-probs (``old_log_probs``). They differ by numerics (another
program, another batch shape, bf16 vs f32) and, when the sampling weights
lag the trained ones, by staleness. With ``log_ratio = old - rollout`` per
token:

- importance sampling (``rollout_is``): weights ``exp(log_ratio)`` per token,
  or ``exp(sum of the response's log_ratio)`` per sequence, truncated at
  ``rollout_is_threshold`` (TIS), optionally divided by their batch mean; the
  policy loss multiplies each token's loss by its weight;
- rejection (``rollout_rs``): tokens (token), or whole responses (sequence:
  the product of ratios; geometric: their geometric mean), whose ratio falls
  outside [lower, upper] leave the response mask;
- veto (``rollout_token_veto_threshold``): a response with one token whose
  ratio is below the threshold leaves the mask entirely.

Ratios are exponentiated from log-ratios clipped to +-20 (exp(20) ~ 5e8), as
verl does. Metrics (``rollout_corr/...``, verl's names) describe the weights
before truncation and the gap between the two policies (KL, perplexities, chi^2).
Everything here is a pure function of arrays and can run under ``jit``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

Array = jnp.ndarray

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """``algorithm.rollout_correction`` (None switches a part off)."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None
    rollout_token_veto_threshold: float | None = None

    def __post_init__(self):
        key = "algorithm.rollout_correction."
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"{key}rollout_is={self.rollout_is!r}: choose token, sequence or null")
        if self.rollout_rs is not None and self.rollout_rs not in RS_LEVELS:
            raise ValueError(f"{key}rollout_rs={self.rollout_rs!r}: choose token, sequence, geometric or null")
        if self.rollout_is is not None and not self.rollout_is_threshold > 0:
            raise ValueError(f"{key}rollout_is_threshold={self.rollout_is_threshold} must be > 0")
        if self.rollout_rs is not None:
            if self.rollout_rs_threshold is None or not self.rollout_rs_threshold > 0:
                raise ValueError(f"{key}rollout_rs={self.rollout_rs} needs rollout_rs_threshold > 0 "
                                 f"(got {self.rollout_rs_threshold})")
            lower = self.rs_lower
            if not 0 < lower <= self.rollout_rs_threshold:
                raise ValueError(f"{key}rollout_rs_threshold_lower={lower} must be in (0, rollout_rs_threshold]")
        if self.rollout_token_veto_threshold is not None and not self.rollout_token_veto_threshold > 0:
            raise ValueError(f"{key}rollout_token_veto_threshold={self.rollout_token_veto_threshold} must be > 0")

    @property
    def enabled(self) -> bool:
        return (self.rollout_is is not None or self.rollout_rs is not None
                or self.rollout_token_veto_threshold is not None)

    @property
    def rs_lower(self) -> float:
        if self.rollout_rs_threshold_lower is not None:
            return float(self.rollout_rs_threshold_lower)
        return 1.0 / float(self.rollout_rs_threshold)


def correction_from_config(section: Any, tis_imp_ratio_cap: float = -1.0) -> RolloutCorrection:
    """``algorithm.rollout_correction`` (a mapping), or verl's older ``actor.tis_imp_ratio_cap`` (> 0: token-level
    truncated importance sampling with that cap)."""
    spec = RolloutCorrection(**{f.name: section[f.name] for f in dataclasses.fields(RolloutCorrection)})
    if tis_imp_ratio_cap is not None and float(tis_imp_ratio_cap) > 0:
        if spec.rollout_is is not None:
            raise ValueError("actor_rollout_ref.actor.tis_imp_ratio_cap and algorithm.rollout_correction.rollout_is "
                             "both switch importance sampling on: keep one (rollout_is=token with "
                             "rollout_is_threshold=cap is the same)")
        spec = dataclasses.replace(spec, rollout_is="token", rollout_is_threshold=float(tis_imp_ratio_cap))
    return spec


def _masked_mean(x: Array, mask: Array, axis=None) -> Array:
    return jnp.sum(x * mask, axis=axis) / jnp.maximum(jnp.sum(mask, axis=axis), 1.0)


def _level_log_ratio(log_ratio: Array, mask: Array, level: str) -> Array:
    """(N, 1) per sequence (sum or mean of the response's log-ratios) or (N, R) per token, unclipped."""
    if level == "token":
        return log_ratio
    total = jnp.sum(log_ratio * mask, axis=-1, keepdims=True)
    if level == "sequence":
        return total
    return total / jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)  # geometric


def _ratio_stats(prefix: str, weights: Array, level_lr: Array, mask: Array, upper: float, lower: float) -> dict:
    """Mean/max/min of the (untruncated) ratios and the fractions above ``upper`` and below ``lower``."""
    rows = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
    out = {f"{prefix}_mean": _masked_mean(weights, mask)}
    if level_lr.shape[-1] == 1:  # per sequence: statistics over the responses, in log space
        lr = level_lr[:, 0]
        out[f"{prefix}_max"] = jnp.exp(jnp.minimum(jnp.max(jnp.where(rows > 0, lr, -jnp.inf)), SAFETY_BOUND))
        out[f"{prefix}_min"] = jnp.exp(jnp.min(jnp.where(rows > 0, lr, jnp.inf)))
        out[f"{prefix}_ratio_fraction_high"] = _masked_mean((lr > jnp.log(upper)).astype(jnp.float32), rows)
        out[f"{prefix}_ratio_fraction_low"] = _masked_mean((lr < jnp.log(lower)).astype(jnp.float32), rows)
    else:
        out[f"{prefix}_max"] = jnp.max(jnp.where(mask > 0, weights, -jnp.inf))
        out[f"{prefix}_min"] = jnp.min(jnp.where(mask > 0, weights, jnp.inf))
        out[f"{prefix}_ratio_fraction_high"] = _masked_mean((weights > upper).astype(jnp.float32), mask)
        out[f"{prefix}_ratio_fraction_low"] = _masked_mean((weights < lower).astype(jnp.float32), mask)
    clamped = jnp.clip(weights, lower, upper)
    mean = _masked_mean(clamped, mask)
    out[f"{prefix}_std"] = jnp.sqrt(jnp.maximum(_masked_mean(clamped**2, mask) - mean**2, 0.0))
    out[f"{prefix}_eff_sample_size"] = 1.0 / _masked_mean((clamped / (mean + 1e-8)) ** 2, mask)
    return out


def importance_weights(log_ratio: Array, mask: Array, level: str, threshold: float,
                       batch_normalize: bool = False) -> tuple[Array, dict]:
    """Truncated importance weights (N, R), 0 where ``mask`` is 0, and their metrics (before truncation)."""
    level_lr = _level_log_ratio(log_ratio, mask, level)
    weights = jnp.broadcast_to(jnp.exp(jnp.clip(level_lr, -SAFETY_BOUND, SAFETY_BOUND)), mask.shape) * mask
    metrics = _ratio_stats("rollout_is", weights, level_lr, mask, threshold, 1.0 / threshold)
    weights = jnp.minimum(weights, threshold)
    if batch_normalize:
        if level == "token":
            mean = _masked_mean(weights, mask)
        else:
            rows = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
            mean = _masked_mean(_masked_mean(weights, mask, axis=-1), rows)
        weights = jnp.where(mean > 1e-8, weights / jnp.where(mean > 1e-8, mean, 1.0), weights)
        metrics["rollout_is_batch_norm_factor"] = jnp.where(mean > 1e-8, mean, 1.0)
    return weights, metrics


def rejection_mask(log_ratio: Array, mask: Array, level: str, upper: float, lower: float) -> tuple[Array, dict]:
    """The response mask without the tokens (or responses) whose ratio is outside [lower, upper]; metrics."""
    level_lr = _level_log_ratio(log_ratio, mask, level)
    ratio = jnp.broadcast_to(jnp.exp(jnp.clip(level_lr, -SAFETY_BOUND, SAFETY_BOUND)), mask.shape)
    keep = ((ratio >= lower) & (ratio <= upper)).astype(mask.dtype)
    metrics = _ratio_stats("rollout_rs", ratio * mask, level_lr, mask, upper, lower)
    metrics["rollout_rs_masked_fraction"] = _masked_mean(1.0 - keep, mask)
    rows = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
    rejected_row = jnp.sum((1.0 - keep) * mask, axis=-1) > 0
    metrics["rollout_rs_seq_masked_fraction"] = _masked_mean(rejected_row.astype(jnp.float32), rows)
    return mask * keep, metrics


def veto_mask(log_ratio: Array, mask: Array, threshold: float) -> tuple[Array, dict]:
    """The response mask without every response that has a token whose ratio is below ``threshold``; metrics."""
    catastrophic = (log_ratio < jnp.log(threshold)) & (mask > 0)
    vetoed = jnp.any(catastrophic, axis=-1, keepdims=True)
    rows = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
    metrics = {
        "rollout_is_veto_fraction": _masked_mean(vetoed[:, 0].astype(jnp.float32), rows),
        "rollout_is_catastrophic_token_fraction": _masked_mean(catastrophic.astype(jnp.float32), mask),
    }
    return mask * (~vetoed).astype(mask.dtype), metrics


def offpolicy_metrics(old_log_probs: Array, rollout_log_probs: Array, mask: Array) -> dict:
    """How far apart the trainer's and the sampler's policies are on the sampled tokens."""
    rows = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
    log_ratio = old_log_probs - rollout_log_probs
    mean_train = _masked_mean(old_log_probs, mask, axis=-1)
    mean_rollout = _masked_mean(rollout_log_probs, mask, axis=-1)
    log_ppl_diff = mean_rollout - mean_train
    rho = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    seq_lr = jnp.clip(jnp.sum(log_ratio * mask, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
    return {
        "kl": _masked_mean(-log_ratio, mask),
        "k3_kl": _masked_mean(jnp.exp(log_ratio) - log_ratio - 1.0, mask),
        "training_ppl": _masked_mean(jnp.exp(-mean_train), rows),
        "rollout_ppl": _masked_mean(jnp.exp(-mean_rollout), rows),
        "log_ppl_diff": _masked_mean(log_ppl_diff, rows),
        "log_ppl_abs_diff": _masked_mean(jnp.abs(log_ppl_diff), rows),
        "ppl_ratio": _masked_mean(jnp.exp(log_ppl_diff), rows),
        "chi2_token": _masked_mean(rho**2, mask) - 1.0,
        "chi2_seq": _masked_mean(jnp.exp(2.0 * seq_lr), rows) - 1.0,
    }


def mismatch_metrics(old_log_probs: Array, rollout_log_probs: Array, response_mask: Array) -> dict:
    """How far the sampler's log-probs are from the trainer's recomputation of the same tokens, as verl reports it
    whether or not a correction is on: ``training/rollout_probs_diff_{max,mean,std}`` (|p_train - p_rollout| per
    sampled token, in probability space; std with n - 1), ``training/rollout_actor_probs_pearson_corr`` and the
    ``rollout_corr/`` divergences of ``offpolicy_metrics`` (``kl``: mean of log p_rollout - log p_train)."""
    mask = response_mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    p_train, p_rollout = jnp.exp(old_log_probs), jnp.exp(rollout_log_probs)
    diff = jnp.abs(p_train - p_rollout)
    mean = jnp.sum(diff * mask) / count
    std = jnp.sqrt(jnp.sum((diff - mean) ** 2 * mask) / jnp.maximum(count - 1.0, 1.0))
    centred_t = (p_train - jnp.sum(p_train * mask) / count) * mask
    centred_r = (p_rollout - jnp.sum(p_rollout * mask) / count) * mask
    pearson = jnp.sum(centred_t * centred_r) / jnp.maximum(
        jnp.sqrt(jnp.sum(centred_t**2) * jnp.sum(centred_r**2)), 1e-30)
    out = {"training/rollout_probs_diff_max": jnp.max(jnp.where(mask > 0, diff, 0.0)),
           "training/rollout_probs_diff_mean": mean, "training/rollout_probs_diff_std": std,
           "training/rollout_actor_probs_pearson_corr": pearson}
    out.update({f"rollout_corr/{k}": v for k, v in offpolicy_metrics(old_log_probs, rollout_log_probs, mask).items()})
    return out


def rollout_correction(old_log_probs: Array, rollout_log_probs: Array, response_mask: Array,
                       cfg: RolloutCorrection) -> tuple[Array | None, Array, dict]:
    """(importance weights or None, response mask after rejection and veto, ``rollout_corr/`` metrics).

    Metrics are computed on the response mask as given; only the loss sees the reduced one.
    """
    mask = response_mask.astype(jnp.float32)
    log_ratio = (old_log_probs - rollout_log_probs) * mask
    metrics: dict = {}
    weights = None
    if cfg.rollout_is is not None:
        weights, m = importance_weights(log_ratio, mask, cfg.rollout_is, cfg.rollout_is_threshold,
                                        cfg.rollout_is_batch_normalize)
        metrics.update(m)
    kept = mask
    if cfg.rollout_rs is not None:
        kept, m = rejection_mask(log_ratio, mask, cfg.rollout_rs, float(cfg.rollout_rs_threshold), cfg.rs_lower)
        metrics.update(m)
    if cfg.rollout_token_veto_threshold is not None:
        vetoed, m = veto_mask(log_ratio, mask, float(cfg.rollout_token_veto_threshold))
        kept = kept * vetoed
        metrics.update(m)
    metrics.update(offpolicy_metrics(old_log_probs, rollout_log_probs, mask))
    return weights, kept.astype(response_mask.dtype), {f"rollout_corr/{k}": v for k, v in metrics.items()}
