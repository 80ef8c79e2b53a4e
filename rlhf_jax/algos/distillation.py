"""On-policy distillation's loss (verl's ``distillation.distillation_loss``), pure functions.

Two kinds of per-token divergence ``d`` between the student (the actor) and the teacher:

- verl's single-sample estimators (``k1``/``kl``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``):
  ``d = kl_penalty(log pi_student(y), log pi_teacher(y), loss_mode)`` of each sampled token ``y``;
- ``forward_kl_topk`` (verl's ``compute_forward_kl_topk``): over the teacher's k most probable tokens ``K`` at each
  position, ``d = max(0, sum_{v in K} p_t(v) (log p_t(v) - log p_s(v)))``, with ``log p_t`` / ``log p_s`` the full
  log-softmax of each model gathered at ``K`` -- not renormalised over ``K`` (so the sum can be negative, hence the
  ``max(0, .)``) -- and, with ``log_prob_min_clamp`` c, both clamped below at c before the sum (``p_t`` too is
  ``exp`` of the clamped value). Logged: ``student_mass`` / ``teacher_mass`` = sum over ``K`` of each model's
  probabilities (before the clamp), means over the response tokens.

``d`` is then clamped to ``[-loss_max_clamp, loss_max_clamp]`` and either trained directly, aggregated like any
token loss, or, with ``use_policy_gradient``, used as a reward: ``-d`` (without gradient) is each token's advantage
in PPO's clipped loss against the old policy (with ``forward_kl_topk`` the gradient then flows only through the
sampled token's log-prob, as in verl).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .aggregation import agg_loss, masked_mean
from .kl import kl_penalty
from .policy_losses import policy_loss

Array = jnp.ndarray

FORWARD_KL_TOPK = "forward_kl_topk"


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
    log_prob_min_clamp: float | None = None  # forward_kl_topk's lower bound of both models' log-probs

    @property
    def uses_topk(self) -> bool:
        """The loss reads the teacher's top-k distribution (not the sampled tokens' log-probs)."""
        return self.loss_mode == FORWARD_KL_TOPK


def forward_kl_topk(student_topk_log_probs: Array, teacher_topk_log_probs: Array,
                    log_prob_min_clamp: float | None = None) -> tuple[Array, Array, Array]:
    """(divergence, student mass, teacher mass), each (..., ) from the two models' (..., k) log-probs of the
    teacher's top-k tokens (verl's ``compute_forward_kl_topk``; see the module docstring)."""
    s = student_topk_log_probs.astype(jnp.float32)
    t = teacher_topk_log_probs.astype(jnp.float32)
    student_mass, teacher_mass = jnp.sum(jnp.exp(s), -1), jnp.sum(jnp.exp(t), -1)
    if log_prob_min_clamp is not None:
        s, t = jnp.maximum(s, log_prob_min_clamp), jnp.maximum(t, log_prob_min_clamp)
    divergence = jnp.maximum(jnp.sum(jnp.exp(t) * (t - s), -1), 0.0)
    return divergence, student_mass, teacher_mass


def per_token_divergence(spec: DistillSpec, log_prob: Array, teacher_log_prob: Array | None, mask: Array, *,
                         student_topk_log_probs: Array | None = None,
                         teacher_topk_log_probs: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """(d (N, R) before ``loss_max_clamp``, metrics) of ``spec.loss_mode``."""
    if spec.uses_topk:
        d, student_mass, teacher_mass = forward_kl_topk(student_topk_log_probs, teacher_topk_log_probs,
                                                        spec.log_prob_min_clamp)
        sg = jax.lax.stop_gradient
        return d, {"student_mass": masked_mean(sg(student_mass), mask),
                   "teacher_mass": masked_mean(sg(teacher_mass), mask)}
    d = kl_penalty(log_prob, teacher_log_prob, spec.loss_mode)
    return d, {"abs_loss": masked_mean(jnp.abs(jax.lax.stop_gradient(d)), mask)}


def distillation_loss(spec: DistillSpec, log_prob: Array, old_log_prob: Array, teacher_log_prob: Array | None,
                      response_mask: Array, loss_agg_mode: str, *, denominator: Array | float | None = None,
                      norm_constant: float | None = None, student_topk_log_probs: Array | None = None,
                      teacher_topk_log_probs: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """(loss, metrics) of one (micro-)batch; ``denominator`` is the mini-batch's for ``loss_agg_mode``.

    ``log_prob`` / ``old_log_prob`` (N, R): the student's current and old log-probs of the sampled tokens;
    ``teacher_log_prob`` (N, R): the teacher's of the same tokens (the estimators'); ``forward_kl_topk`` reads
    ``student_topk_log_probs`` / ``teacher_topk_log_probs`` (N, R, k) at the teacher's top-k tokens instead.
    """
    mask = response_mask.astype(log_prob.dtype)
    per_token, metrics = per_token_divergence(spec, log_prob, teacher_log_prob, mask,
                                              student_topk_log_probs=student_topk_log_probs,
                                              teacher_topk_log_probs=teacher_topk_log_probs)
    if spec.loss_max_clamp is not None:
        per_token = jnp.clip(per_token, -spec.loss_max_clamp, spec.loss_max_clamp)
    if not spec.use_policy_gradient:
        return agg_loss(per_token, mask, loss_agg_mode, denominator=denominator, norm_constant=norm_constant), metrics
    loss, pg = policy_loss("vanilla", old_log_prob=old_log_prob, log_prob=log_prob,
                           advantages=-jax.lax.stop_gradient(per_token), response_mask=mask,
                           loss_agg_mode=loss_agg_mode, clip_ratio_low=spec.clip_ratio_low,
                           clip_ratio_high=spec.clip_ratio_high, denominator=denominator, norm_constant=norm_constant)
    return loss, {**metrics, **pg}
