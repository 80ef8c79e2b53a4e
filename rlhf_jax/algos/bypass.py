"""verl's bypass mode (``algorithm.rollout_correction.bypass_mode``): the sampler's log-probs are the old policy.

The old-log-prob forward pass is skipped; ``old_log_prob`` here is the sampler's. The rollout correction compares the
current policy (without gradient) with the sampler's, per micro-batch, inside the loss: rejection (and veto) always
leave the loss's mask; the importance weights multiply the REINFORCE loss only, since PPO's ratio current / sampler
already is the importance ratio (weighting it again would count it twice). ``loss_type``:

- ``ppo_clip``: PPO's clipped loss (``vanilla``) with ratio current / sampler;
- ``reinforce``: ``-A * log pi`` per token, times the truncated weights when ``rollout_is`` is set.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .aggregation import masked_mean
from .policy_losses import aggregate_policy_loss, policy_metrics, vanilla
from .registry import register_policy_loss
from .rollout_correction import RolloutCorrection, rollout_correction

Array = jnp.ndarray
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


@register_policy_loss("bypass_mode")
def bypass_mode(*, old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array,
                correction: RolloutCorrection = RolloutCorrection(), loss_type: str = "ppo_clip",
                **kw: Any) -> tuple[Array, dict[str, Array]]:
    """The policy loss with ``old_log_prob`` = the sampler's; metrics add the ``rollout_corr/`` ones."""
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"algorithm.rollout_correction.loss_type={loss_type!r}: choose "
                         f"{' or '.join(BYPASS_LOSS_TYPES)}")
    kw.pop("rollout_is_weights", None)  # computed here, against the current policy
    weights, kept, corr = rollout_correction(jax.lax.stop_gradient(log_prob), old_log_prob, response_mask, correction)
    kept = kept.astype(log_prob.dtype)
    if loss_type == "ppo_clip":
        loss, metrics = vanilla(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                                response_mask=kept, **kw)
    else:
        kw = {k: v for k, v in kw.items() if k not in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")}
        loss = aggregate_policy_loss(-advantages * log_prob, {**kw, "response_mask": kept, "rollout_is_weights": weights})
        zero = jnp.zeros((), jnp.float32)
        metrics = policy_metrics(zero, zero, masked_mean(old_log_prob - jax.lax.stop_gradient(log_prob), kept))
    return loss, {**metrics, **corr}
