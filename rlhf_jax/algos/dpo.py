"""Direct Preference Optimization: the pairwise loss and TRL's metrics, from sequence log-probs.

Every input is (B,): the summed log-prob of each pair's chosen / rejected response under the policy and
under the frozen reference. With the log-ratio margin

    m = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)

the losses per pair are (Rafailov et al. 2023; TRL's ``loss_type`` names):

- ``sigmoid``: -(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m)  (eps = label smoothing, the
  conservative DPO of noisy labels; eps = 0 is plain DPO),
- ``hinge``: max(0, 1 - beta m)  (SLiC),
- ``ipo``: (m - 1 / (2 beta))^2  (IPO; beta is its tau).

The implicit rewards are beta times each response's log-ratio (TRL's rewards/chosen, rewards/rejected);
an accuracy counts a pair whose chosen reward is strictly larger. Losses and metrics are sums over the given
pairs divided by ``denominator`` (the mini-batch's pair count), so micro-batch sums add up to the mini-batch
mean exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def check_loss_type(name: str) -> None:
    if name not in LOSS_TYPES:
        raise ValueError(f"unknown DPO loss type {name!r}; choose one of {', '.join(LOSS_TYPES)}")


def pair_losses(margin, *, beta: float, label_smoothing: float = 0.0, loss_type: str = "sigmoid"):
    """The loss of each pair (B,) from its log-ratio margin (B,)."""
    check_loss_type(loss_type)
    if loss_type == "sigmoid":
        return (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * margin)
                - label_smoothing * jax.nn.log_sigmoid(-beta * margin))
    if loss_type == "hinge":
        return jax.nn.relu(1.0 - beta * margin)
    return (margin - 1.0 / (2.0 * beta)) ** 2


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta: float, label_smoothing: float = 0.0,
             loss_type: str = "sigmoid", denominator=None, weights=None):
    """(loss, metrics) of a batch of pairs; every array (B,) float32.

    ``weights`` (B,) of 0/1 leave padding pairs out; ``denominator`` defaults to the number of counted pairs.
    Metrics (TRL's names) are detached: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
    logps/chosen, logps/rejected.
    """
    w = jnp.ones_like(policy_chosen) if weights is None else weights.astype(policy_chosen.dtype)
    den = jnp.sum(w) if denominator is None else denominator
    den = jnp.maximum(den, 1.0)
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    losses = pair_losses(chosen_ratio - rejected_ratio, beta=beta, label_smoothing=label_smoothing,
                         loss_type=loss_type)
    loss = jnp.sum(losses * w) / den
    chosen_rewards = jax.lax.stop_gradient(beta * chosen_ratio)
    rejected_rewards = jax.lax.stop_gradient(beta * rejected_ratio)
    mean = lambda x: jnp.sum(x * w) / den  # noqa: E731
    metrics = {
        "loss": jax.lax.stop_gradient(loss),
        "rewards/chosen": mean(chosen_rewards),
        "rewards/rejected": mean(rejected_rewards),
        "rewards/accuracies": mean((chosen_rewards > rejected_rewards).astype(policy_chosen.dtype)),
        "rewards/margins": mean(chosen_rewards - rejected_rewards),
        "logps/chosen": mean(jax.lax.stop_gradient(policy_chosen)),
        "logps/rejected": mean(jax.lax.stop_gradient(policy_rejected)),
    }
    return loss, metrics
