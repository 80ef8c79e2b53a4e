"""Experience generated ahead of training: rounds of rollout batches, trained on one per step, in order.

``experience.buffer_size`` = K: a round is K rollout batches sampled with one set of weights (seed 000's
experience buffer). Sequentially, a round is produced when nothing is left to train on; the i-th batch of a
round is then trained i updates after its weights (staleness K - 1 at most). With ``experience.overlap`` the
next round is produced on the rollout devices while the current round's first batch trains, so a batch lags
its trained weights by K to 2K - 1 updates (1 for K = 1: one-step off-policy).

Every batch records the weight version (updates applied) that sampled it. What is produced but not yet trained
on is part of each checkpoint: its arrays, and the loader position before its prompts, from which a resumed run
draws the same prompt batches again (the prompts' metadata is not stored). A resumed run therefore trains on
exactly the batches an uninterrupted one would, in the same order.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rlhf_jax.types import ROLLOUT_ARRAYS, ROLLOUT_OPTIONAL, RolloutBatch, ScoredBatch


def production_due(pending: int, buffer_size: int, overlap: bool) -> bool:
    """Whether a step starts by producing a round: when nothing is pending, or (overlap) when only the current
    round is left, so that the next one is sampled while it trains."""
    return pending <= (buffer_size if overlap else 0)


def implied_staleness(buffer_size: int, overlap: bool) -> int:
    """The largest lag, in updates, between a batch's sampling weights and the weights it is trained from."""
    return 2 * buffer_size - 1 if overlap else buffer_size - 1


def to_checkpoint(queue: list[ScoredBatch]) -> tuple[dict[str, jax.Array], list[dict]]:
    """(arrays, description) of the pending batches: a flat ``{"<i>.<name>": array}`` item and a JSON list."""
    arrays, described = {}, []
    for i, exp in enumerate(queue):
        fields = {name: getattr(exp.rollout, name) for name in ROLLOUT_ARRAYS}
        for optional in ROLLOUT_OPTIONAL:  # multi-turn's tool tokens, partial rollouts' versions, R3's routes
            if getattr(exp.rollout, optional) is not None:
                fields[optional] = getattr(exp.rollout, optional)
        fields["scores"] = exp.scores
        domain = getattr(exp.prompts, "domain", None)  # the kept rows' (dynamic sampling mixes batches)
        if exp.baselines is not None:
            fields["baselines"] = exp.baselines
        if exp.components is not None:
            fields["components"] = exp.components
        arrays.update({f"{i}.{name}": x for name, x in fields.items()})
        described.append({"version": int(exp.version), "metrics": {k: float(v) for k, v in exp.metrics.items()},
                          "arrays": {name: [list(x.shape), str(x.dtype)] for name, x in fields.items()},
                          "draws": int(exp.draws), "domain": None if domain is None else [int(d) for d in domain]})
    return arrays, described


def templates(described: list[dict], sharding_of) -> dict[str, jax.ShapeDtypeStruct]:
    """Restore targets of ``to_checkpoint``'s arrays; ``sharding_of(ndim)`` gives a row sharding."""
    out = {}
    for i, d in enumerate(described):
        for name, (shape, dtype) in d["arrays"].items():
            out[f"{i}.{name}"] = jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding_of(len(shape)))
    return out


def from_checkpoint(arrays: dict[str, jax.Array], described: list[dict], prompt_batches: list,
                    data_states: list) -> list[ScoredBatch]:
    """The pending batches again, with the prompt batches (and loader states) drawn anew by the caller."""
    queue = []
    for i, (d, pb, state) in enumerate(zip(described, prompt_batches, data_states)):
        out = RolloutBatch(**{name: arrays[f"{i}.{name}"] for name in ROLLOUT_ARRAYS},
                           **{name: arrays.get(f"{i}.{name}") for name in ROLLOUT_OPTIONAL})
        queue.append(ScoredBatch(rollout=out, scores=arrays[f"{i}.scores"], baselines=arrays.get(f"{i}.baselines"),
                                 prompts=pb, version=int(d["version"]), data_state=state, metrics=dict(d["metrics"]),
                                 components=arrays.get(f"{i}.components"), draws=int(d.get("draws", 1))))
    return queue


def checkpoint_pending(pending: list[ScoredBatch], loader) -> tuple[dict, list[dict], Any]:
    """(arrays, description, the loader's state before the first pending batch's prompts) of a buffer's pending
    batches (the loader's state now when none is pending)."""
    arrays, described = to_checkpoint(pending)
    return arrays, described, pending[0].data_state if pending else loader.get_state()


def restore_pending(loader, arrays: dict, described: list[dict]) -> list[ScoredBatch]:
    """The pending batches of a checkpoint, their prompts drawn again from ``loader`` (standing before them): as
    many batches per pending batch as it drew (dynamic sampling draws further ones), so that the loader ends where
    the checkpointed run's stood; a batch's prompts are the last it drew, with the domains of the rows it kept."""
    pbs, states = [], []
    for d in described:
        states.append(loader.get_state())
        for _ in range(int(d.get("draws", 1))):
            pb = next(loader)
        if d.get("domain") is not None:
            pb = pb.replace(domain=np.asarray(d["domain"], np.int32))
        pbs.append(pb)
    return from_checkpoint(arrays, described, pbs, states)
