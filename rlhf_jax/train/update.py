"""The updates of one RL step: epochs of mini-batches of a TrainBatch, each one optimizer step of a loss.

Mini-batch rows are shuffled per (seed, step, epoch, role) when the role's ``shuffle`` is set, so a resumed run
draws the order the uninterrupted one would. The actor's steps take a key per mini-batch derived from (seed,
step); the critic's none.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rlhf_jax.train.batching import mini_batches
from rlhf_jax.train.losses import Loss
from rlhf_jax.types import TrainBatch


@dataclasses.dataclass(frozen=True)
class UpdateSchedule:
    """How one role's loss walks a batch."""

    fields: tuple[str, ...]  # the per-token arrays its loss reads (StepPasses.fields)
    epochs: int
    mini_batches: int
    shuffle: bool
    salt: int  # tells the roles' row orders apart (actor 0, critic 1)


def permutation(n: int, seed: int, step: int, epoch: int, salt: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, step, epoch, salt]).permutation(n)


def update_role(role, loss: Loss, layout, batch: TrainBatch, schedule: UpdateSchedule, *, mesh, seed: int,
                step: int) -> dict[str, float]:
    """Train ``role`` on ``batch`` per ``schedule`` (``layout``: the pass's Padded | Packed); the metrics averaged
    over its optimizer steps."""
    carried = layout.carried(batch.only(schedule.fields))
    rows, num = batch.response_mask.shape[0], schedule.mini_batches
    update_key = jax.random.fold_in(jax.random.key(seed), step) if loss.takes_rng else None
    collected: dict[str, list] = {}
    for epoch in range(schedule.epochs):
        perm = permutation(rows, seed, step, epoch, schedule.salt, schedule.shuffle)
        for i, mb in enumerate(mini_batches(mesh, carried, num, perm)):
            key = jax.random.fold_in(update_key, epoch * 1000 + i) if update_key is not None else None
            for k, v in layout.update(role, loss, mb, rows=perm[i::num], rng=key).items():
                collected.setdefault(k, []).append(v)
    return {k: float(np.mean([float(x) for x in v])) for k, v in collected.items()}
