"""Host side of ``conversation``: jitted append / decode programs for a batch of conversations, and counters.

``ConversationSampler`` holds the compiled programs of one model architecture on one mesh with fixed settings
(capacity, staging width, sampling parameters, stop sequences, turn length). Appended tokens are cut into chunks
of at most ``stage`` tokens, each padded to a power of two, so a run compiles a handful of append programs.
``prefilled_tokens`` counts the real tokens appended (prompts and later turns' new tokens): a conversation that
continues from its cache adds only what is new.

Over several processes (a mesh whose devices several processes hold) every host call takes and returns this
process's rows (block p of the global rows, as ``parallel.hosts.to_global`` lays them out), and every process
makes the same calls in the same order: what decides a program's shape (the widest new row) is agreed over the
processes first.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rlhf_jax.parallel.hosts import all_rows, to_local
from rlhf_jax.parallel.mesh import DEFAULT_RULES, Rules, replicated
from rlhf_jax.rollout import conversation
from rlhf_jax.rollout.buckets import next_power_of_two
from rlhf_jax.rollout.conversation import Conversations, TurnOutput
from rlhf_jax.rollout.params import SamplingParams
from rlhf_jax.rollout.sampler import mesh_of
from rlhf_jax.rollout.shards import BatchShards


class ConversationSampler:
    """Compiled conversation programs for one model (its graphdef) and one set of settings."""

    def __init__(self, graphdef: nnx.GraphDef, config, *, capacity: int, params: SamplingParams, turn_len: int,
                 stop_sequences: Sequence[Sequence[int]] = (), stage: int = 64, mesh: Mesh | None = None,
                 rules: Rules = DEFAULT_RULES):
        self.graphdef = graphdef
        self.capacity = int(capacity)
        self.stage = next_power_of_two(max(1, int(stage)))
        self.params = params.static_key()
        self.record_routes = bool(params.record_routes)  # R3: every token's experts, read with ``routes``
        self.turn_len = int(turn_len)
        self.stop_sequences = tuple(tuple(int(t) for t in s) for s in stop_sequences if len(s))
        self.mesh = mesh
        self.rules = tuple(rules)
        if self.capacity > config.max_position_embeddings:
            raise ValueError(f"a conversation of {self.capacity} tokens exceeds the model's context of "
                             f"{config.max_position_embeddings} tokens; lower data.max_prompt_length or "
                             f"rollout.response_length")
        conversation.check_model(config, self.capacity + self.stage)
        self.num_kv_heads = config.num_key_value_heads
        self.prefilled_tokens = 0  # real tokens appended (prompts, tool responses)
        self.appended_columns = 0  # rows x staging width of every append call (what the device computed)
        self.decoded_tokens = 0  # tokens drawn by decode turns
        self.trace_count = 0
        self._shards_of: dict[Mesh, BatchShards] = {}  # one object per mesh: it is a static argument of the jits
        # Callers on several threads (workflow clients) take this around their device work, which keeps the
        # counters above consistent and batches their requests. (The waits seen on XLA:CPU with 8 devices when
        # several threads dispatched at once were its thread pool running out: runtime/cpu_collectives.py.)
        self.device_lock = threading.Lock()

    @classmethod
    def for_model(cls, model: nnx.Module, **kwargs) -> "ConversationSampler":
        graphdef, _ = nnx.split(model)
        return cls(graphdef, model.config, **kwargs)

    def _shards(self, state: Any) -> BatchShards:
        mesh = self.mesh if self.mesh is not None else mesh_of(state)
        if mesh not in self._shards_of:
            self._shards_of[mesh] = BatchShards(mesh, self.rules, self.num_kv_heads)
        return self._shards_of[mesh]

    def shard_count(self, state: Any) -> int:
        """Data-parallel shards this process's rows split over (its rows are padded to a multiple of it)."""
        shards = self._shards(state)
        return shards.count // _processes(shards.mesh)

    def _rows(self, shards: BatchShards, x, ndim: int):
        """This process's rows of a batch as the global batch-sharded array."""
        sharding = NamedSharding(shards.mesh, shards.rows(ndim))
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    # ------------------------------------------------------------------ traced programs (cached by jax.jit)
    @functools.partial(jax.jit, static_argnums=(0, 2, 3))
    def _empty(self, state, rows: int, shards: BatchShards):
        self.trace_count += 1
        return conversation.empty(nnx.merge(self.graphdef, state), rows, self.capacity, self.stage, shards,
                                  self.record_routes)

    @functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2,))
    def _append(self, state, conv, ids, count, shards: BatchShards):
        self.trace_count += 1
        return conversation.append(nnx.merge(self.graphdef, state), conv, ids, count, shards)

    @functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=(2,))
    def _decode(self, state, conv, limit, start, row_ids, key, shards: BatchShards):
        self.trace_count += 1
        return conversation.decode_turn(nnx.merge(self.graphdef, state), conv, limit, start, row_ids, key,
                                        self.params, self.stop_sequences, self.turn_len, shards)

    # ------------------------------------------------------------------ host API
    def start(self, state: Any, rows: int) -> Conversations:
        """``rows`` empty conversations of this process (they must split over its data-parallel shards; every
        process starts as many)."""
        shards = self._shards(state)
        rows *= _processes(shards.mesh)
        shards.per_shard(rows, "conversations")
        return self._empty(state, rows, shards)

    def append(self, state: Any, conv: Conversations, new_ids: Sequence[Sequence[int]]) -> Conversations:
        """Append each of this process's rows' new tokens (an empty list leaves a row as it is), ``stage`` tokens per
        call at most."""
        shards = self._shards(state)
        rows = [list(map(int, r)) for r in new_ids]
        own = conv.length.shape[0] // _processes(shards.mesh)
        if len(rows) != own:
            raise ValueError(f"{len(rows)} rows of new tokens for {own} conversations")
        # the calls below and their widths follow every process's rows, so that all make the same ones
        lengths = all_rows(np.asarray([len(r) for r in rows], np.int64))
        offset = 0
        longest = int(lengths.max(initial=0))
        while offset < longest:
            pieces = [r[offset:offset + self.stage] for r in rows]
            width = next_power_of_two(int(np.clip(lengths - offset, 0, self.stage).max()))
            ids = np.zeros((len(rows), width), np.int32)
            for b, p in enumerate(pieces):
                ids[b, :len(p)] = p
            count = np.asarray([len(p) for p in pieces], np.int32)
            conv = self._append(state, conv, self._rows(shards, ids, 2), self._rows(shards, count, 1), shards)
            self.prefilled_tokens += int(count.sum())
            self.appended_columns += ids.size
            offset += self.stage
        return conv

    def decode(self, state: Any, conv: Conversations, limit: Sequence[int], start: Sequence[int],
               row_ids: Sequence[int], key: jax.Array) -> tuple[Conversations, TurnOutput]:
        """One turn: up to ``limit[b]`` (<= turn_len) tokens per row; the outputs as host NumPy arrays."""
        shards = self._shards(state)
        as_rows = lambda x: self._rows(shards, np.asarray(x, np.int32), 1)  # noqa: E731
        key = jax.device_put(key, replicated(shards.mesh))
        conv, out = self._decode(state, conv, as_rows(np.minimum(limit, self.turn_len)), as_rows(start),
                                 as_rows(row_ids), key, shards)
        out = jax.tree.map(to_local, out)
        self.decoded_tokens += int(out.count.sum())
        return conv, out

    def routes(self, conv: Conversations) -> np.ndarray:
        """(rows, columns, sparse layers, K): the experts each held token was routed to (column = position; -1
        past a row's length). Only with ``params.record_routes``."""
        if conv.routes is None:
            raise ValueError("these conversations record no routes (SamplingParams.record_routes is off)")
        return to_local(conv.routes)

    def lengths(self, conv: Conversations) -> np.ndarray:
        return to_local(conv.length)


def _processes(mesh: Mesh) -> int:
    """How many processes hold the mesh's devices."""
    return len({d.process_index for d in mesh.devices.flat})

