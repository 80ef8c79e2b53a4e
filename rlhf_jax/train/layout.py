"""How a pass lays out its rows: ``Padded`` (the batch's (N, P + R) rows, split into micro-batches of sequences) or
``Packed`` (the sequences laid end to end in rows of a fixed length, batch/packing.py). A pass's plan picks its
layout once (``layout``); the step then calls the same three methods whatever the layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import numpy as np

from rlhf_jax.parallel import groups
from rlhf_jax.batch import pack_batch
from rlhf_jax.parallel import batch_sharding
from rlhf_jax.parallel.hosts import to_global
from rlhf_jax.train import packed_steps
from rlhf_jax.train.losses import Loss
from rlhf_jax.train.passes import PassPlan
from rlhf_jax.types import TrainBatch


class Packer:
    """Packs one batch's sequences into micro-batches on the mesh, and counts the tokens it lays out.

    ``sequences()`` gives the batch's global host arrays ``prompts``, ``prompt_mask``, ``responses`` and
    ``response_valid`` (the response tokens the model reads); it is called once, at the first packing.
    ``tokens[pass]`` = [cells computed, tokens laid in them (shared prompts once)], summed over the pass's calls.
    """

    def __init__(self, mesh, dp: int, pad_token_id: int, sequences: Callable[[], dict[str, np.ndarray]]):
        self.mesh, self.dp, self.pad_token_id, self._sequences = mesh, dp, pad_token_id, sequences
        self._host: dict[str, np.ndarray] | None = None
        self.tokens: dict[str, list[float]] = {}

    def micros(self, plan: PassPlan, rows: np.ndarray | None = None, routes: jax.Array | None = None,
               record_routes: bool = False) -> list[dict] | tuple[list[dict], jax.Array]:
        """Packed micro-batches of the sequences (``rows`` selects and orders a mini-batch) at ``plan``'s size.
        ``routes``: the (mini-)batch's (rows, P + R, sparse layers, K) expert ids, gathered into each micro-batch's
        positions to be replayed; ``record_routes``: (the micro-batches with their ``route_sources``, the
        shard-local row (N,) whose prompt positions hold each sequence's prompt)."""
        if self._host is None:
            self._host = self._sequences()
        host = self._host if rows is None else {k: v[rows] for k, v in self._host.items()}
        packed = pack_batch(host["prompts"], host["prompt_mask"], host["responses"], host["response_valid"],
                            dp=self.dp, row_len=plan.row_len, max_rows_per_micro=plan.rows_per_micro,
                            pad_token_id=self.pad_token_id)
        counts = self.tokens.setdefault(plan.name, [0.0, 0.0])
        counts[0] += float(packed.padded_tokens)
        counts[1] += float(packed.placed_tokens)

        def local(x: np.ndarray) -> np.ndarray:  # this process's shards: a contiguous block of every array
            n = x.shape[0] // groups.process_count()
            return x[groups.process_index() * n:(groups.process_index() + 1) * n]

        micros = [{k: to_global(self.mesh, local(v)) for k, v in packed.micro(i).items()}
                  for i in range(packed.num_micro)]
        if routes is None and not record_routes:
            return micros
        gather = _route_gather(self.mesh, self.dp)
        for i, micro in enumerate(micros):
            sources = to_global(self.mesh, local(packed.route_sources[i]))
            if routes is not None:
                micro["routes"] = gather(routes, sources)
            if record_routes:
                micro["route_sources"] = sources
        return (micros, to_global(self.mesh, local(packed.prompt_rows))) if record_routes else micros

    def metrics(self) -> dict[str, float]:
        """``perf/packed_tokens/<pass>`` and ``perf/placed_tokens/<pass>`` of every pass that packed."""
        return {f"perf/{key}/{name}": counts[i] for name, counts in self.tokens.items()
                for i, key in enumerate(("packed_tokens", "placed_tokens"))}


@dataclasses.dataclass(frozen=True)
class Padded:
    """Micro-batches of ``plan.rows_per_micro`` sequences per shard, in one program per pass."""

    plan: PassPlan

    def log_probs(self, role, batch: TrainBatch, temperature: float, sum_pi_squared: bool = False,
                  record_routes: bool = False, topk: int = 0):
        """Log-probs (N, R); with ``sum_pi_squared`` (those, the sums of squared probabilities); with
        ``record_routes`` (that, the MoE expert ids the pass used); ``topk`` > 0: the top-k (log-probs, ids)
        (N, R, k) instead."""
        return role.log_probs(batch, n_micro=self.plan.num_micro, temperature=temperature,
                              with_sum_pi_squared=sum_pi_squared, record_routes=record_routes, topk=topk)

    def values(self, role, batch: TrainBatch) -> jax.Array:
        return role.values(batch, n_micro=self.plan.num_micro)

    def carried(self, batch: TrainBatch) -> TrainBatch:
        """What an update's mini-batches carry: the whole batch."""
        return batch

    def update(self, role, loss: Loss, mb: TrainBatch, rows: np.ndarray | None = None, rng=None) -> dict:
        """One optimizer step on the mini-batch ``mb`` (``rows``: its rows of the batch, unused here)."""
        del rows
        return role.update(loss, mb, n_micro=self.plan.num_micro, rng=rng)


@dataclasses.dataclass(frozen=True)
class Packed:
    """Micro-batches of ``plan.rows_per_micro`` packed rows per shard, one program call each; the outputs land on
    the batch's (N, R) grid."""

    plan: PassPlan
    packer: Packer

    def log_probs(self, role, batch: TrainBatch, temperature: float, sum_pi_squared: bool = False,
                  record_routes: bool = False, topk: int = 0):
        """Log-probs (N, R); with ``sum_pi_squared`` (those, the sums of squared probabilities); with
        ``record_routes`` (that, the MoE expert ids (N, P + R, sparse layers, K) the pass used, on the sequence
        grid like ``batch.input_ids``); ``topk`` > 0: the top-k (log-probs, ids) (N, R, k) instead. A MoE model
        replays ``batch.routed_experts`` when given."""
        shape, dp = batch.response_mask.shape, self.packer.dp
        micros = self.packer.micros(self.plan, routes=batch.routed_experts, record_routes=record_routes)
        if not record_routes:
            return role.log_probs_packed(micros, shape, dp=dp, temperature=temperature, sum_pi_squared=sum_pi_squared,
                                         topk=topk)
        micros, prompt_rows = micros
        c, width = role.config, batch.input_ids.shape[1] - shape[1]
        empty = jax.device_put(np.full((*batch.input_ids.shape, sum(c.sparse_layers), c.num_experts_per_tok), -1,
                                       np.int32), batch_sharding(self.packer.mesh, 4))
        out, routes = role.log_probs_packed(micros, shape, dp=dp, temperature=temperature,
                                            sum_pi_squared=sum_pi_squared, route_grid=empty)
        return out, _prompt_sharing(self.packer.mesh, dp, width)(routes, prompt_rows)

    def values(self, role, batch: TrainBatch) -> jax.Array:
        return role.values_packed(self.packer.micros(self.plan), batch.response_mask.shape, dp=self.packer.dp)

    def carried(self, batch: TrainBatch) -> TrainBatch:
        """What an update's mini-batches carry: the per-token grid (the packed micro-batches hold the tokens), and
        the expert ids to replay. Each mini-batch is packed afresh (its rows are strided and may be shuffled per
        epoch), so the ids travel on the sequence grid and are gathered into each mini-batch's packing."""
        return batch.grid().replace(routed_experts=batch.routed_experts)

    def update(self, role, loss: Loss, mb: TrainBatch, rows: np.ndarray | None = None, rng=None) -> dict:
        """One optimizer step on the mini-batch ``mb``, packed from the sequences ``rows`` of the batch."""
        micros = self.packer.micros(self.plan, rows, routes=mb.routed_experts)
        return role.update_packed(loss, micros, mb.replace(routed_experts=None), dp=self.packer.dp, rng=rng)


@functools.lru_cache(maxsize=16)
def _route_gather(mesh, dp: int) -> Callable:
    """(grid expert ids, a micro-batch's route_sources) -> its packed expert ids, batch-sharded like its rows."""
    return jax.jit(functools.partial(packed_steps.gather_routes, dp=dp), out_shardings=batch_sharding(mesh, 4))


@functools.lru_cache(maxsize=16)
def _prompt_sharing(mesh, dp: int, prompt_width: int) -> Callable:
    return jax.jit(functools.partial(packed_steps.share_prompt_routes, prompt_width=prompt_width, dp=dp),
                   out_shardings=batch_sharding(mesh, 4))


def layout(plan: PassPlan, packer: Packer) -> Padded | Packed:
    """The layout ``plan`` asks for."""
    return Packed(plan, packer) if plan.packed else Padded(plan)
