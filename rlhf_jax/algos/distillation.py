"""On-policy distillation's loss (verl's ``distillation.distillation_loss``), a pure function.

The per-token divergence ``d = kl_penalty(log pi_student, log pi_teacher, loss_mode)`` of each sampled token
(verl's single-sample estimators) is either trained directly, aggregated like any token loss, or, with
``use_policy_gradient``, used as a reward: ``-d`` (without gradient) is each token's advantage in PPO's clipped
loss against the old policy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .aggregation import agg_loss, masked_mean
from .kl import kl_penalty
from .policy_losses import policy_loss

Array = jnp.ndarray


@dataclasses.dataclass(frozen=True)
class DistillSpec:
    """Static settings (hashable: part of the update program's key), from ``distillation.distillation_loss``."""

    loss_mode: str = "k3"
    use_task_rewards: bool = True
    coef: float = 1.0
    loss_max_clamp: float | None = None
    use_policy_gradient: bool = False
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2


def distillation_loss(spec: DistillSpec, log_prob: Array, old_log_prob: Array, teacher_log_prob: Array,
                      response_mask: Array, loss_agg_mode: str, *, denominator: Array | float | None = None,
                      norm_constant: float | None = None) -> tuple[Array, dict[str, Array]]:
    """(loss, metrics) of one (micro-)batch; ``denominator`` is the mini-batch's for ``loss_agg_mode``."""
    mask = response_mask.astype(log_prob.dtype)
    per_token = kl_penalty(log_prob, teacher_log_prob, spec.loss_mode)
    metrics = {"abs_loss": masked_mean(jnp.abs(jax.lax.stop_gradient(per_token)), mask)}
    if spec.loss_max_clamp is not None:
        per_token = jnp.clip(per_token, -spec.loss_max_clamp, spec.loss_max_clamp)
    if not spec.use_policy_gradient:
        return agg_loss(per_token, mask, loss_agg_mode, denominator=denominator, norm_constant=norm_constant), metrics
    loss, pg = policy_loss("vanilla", old_log_prob=old_log_prob, log_prob=log_prob,
                           advantages=-jax.lax.stop_gradient(per_token), response_mask=mask,
                           loss_agg_mode=loss_agg_mode, clip_ratio_low=spec.clip_ratio_low,
                           clip_ratio_high=spec.clip_ratio_high, denominator=denominator, norm_constant=norm_constant)
    return loss, {**metrics, **pg}
