"""Losses as values: what a role trains is a ``Loss``, which names its settings and the step functions that
train it on padded rows (a whole mini-batch in one program) and on packed rows (one micro-batch's gradient at a
time). A role runs whichever loss it is given; nothing compares names to pick a program.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rlhf_jax.train import packed_steps, sft_steps, steps


@dataclasses.dataclass(frozen=True)
class Loss:
    """One training objective (hashable: part of the compile cache key)."""

    name: str  # the metric prefix of its gradient norm and the name of its programs
    spec: Any  # its static settings (a hashable dataclass, or None)
    padded_step: Callable  # (graphdef, tx, spec, params, frozen, opt_state, mb, [rng], *, n_micro) -> new state
    packed_grads: Callable  # (graphdef, spec, params, frozen, grad_acc, micro, grid, [rng], *, dp) -> (grads, ...)
    takes_rng: bool  # the step takes a PRNG key (the actor's clip_cov loss samples)


def actor(spec: steps.ActorLossSpec) -> Loss:
    """The policy loss (with its KL, entropy, router and shared-value terms)."""
    return Loss("actor", spec, steps.actor_update, packed_steps.actor_grads, takes_rng=True)


def critic(spec: steps.CriticLossSpec) -> Loss:
    """The clipped value loss of a separate critic."""
    return Loss("critic", spec, steps.critic_update, packed_steps.critic_grads, takes_rng=False)


# Supervised fine-tuning: the token mean of the trained tokens' negative log-likelihood.
SFT = Loss("train", None, sft_steps.sft_update, sft_steps.packed_sft_grads, takes_rng=False)
