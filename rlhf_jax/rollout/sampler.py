"""The trainer-facing sampler: compiled rollout programs keyed by static shapes, with a compile counter.

``Sampler`` compiles ``decode.rollout_with_stats`` ahead of time (``jit(...).lower(...).compile()``)
once per (batch, prompt length, sampling settings, parameter layout) and calls
the compiled executable directly afterwards, so ``compile_count`` is exactly
the number of programs it needed. A program another sampler of the same model
compiled in this process is taken from the process's store (runtime/programs.py)
instead of traced again. The parameters are passed in as the actor's own arrays
(``nnx.split(model)[1]``), with their sharding; they are read, never copied or donated.

Typical trainer use::

    sampler = Sampler(graphdef, mesh=mesh)
    batch = sampler.generate(state, prompt_ids_BP, prompt_mask_BP, params, rollout_key(params.seed, step))
    batch, stats = sampler.generate_with_stats(...)  # also: decode steps x slots executed
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rlhf_jax.parallel.mesh import DEFAULT_RULES, Rules, batch_sharding, data_parallel_size, replicated, single_device_mesh
from rlhf_jax.rollout.decode import DecodeStats, RolloutBatch, rollout_with_stats
from rlhf_jax.rollout.params import SamplingParams
from rlhf_jax.rollout.sampling import rollout_key
from rlhf_jax.runtime import programs


def mesh_of(state: Any) -> Mesh:
    """The mesh the parameters live on (a single-device mesh for unsharded arrays)."""
    for leaf in jax.tree.leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
        if sharding is not None:
            return single_device_mesh(next(iter(sharding.device_set)))
    return single_device_mesh()


def _layout(state: Any) -> tuple:
    """Hashable description of the parameters' shapes, dtypes and shardings."""
    leaves, treedef = jax.tree.flatten(state)
    return (treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves))


@functools.partial(jax.jit, static_argnames="dtype")
def _cast(state: Any, dtype: str) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)


def cast_floating(state: Any, dtype: str) -> Any:
    """A copy of ``state`` with its floating-point arrays in ``dtype`` (each keeps its sharding): sampling weights
    in bfloat16 halve what every decode step reads from memory."""
    return _cast(state, dtype=str(jnp.dtype(dtype)))


class Sampler:
    """Compiled samplers for one model architecture (its ``nnx`` graphdef) on one mesh."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        *,
        mesh: Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
        max_positions: int | None = None,
    ):
        self.graphdef = graphdef
        self.max_positions = max_positions  # the model's context length: prompt + response must fit
        self.mesh = mesh
        self.rules = tuple(rules)
        self.compile_count = 0  # programs this sampler needed (compiled, or found in the process's store)
        self.trace_count = 0  # times its rollout function was traced (at most compile_count)
        self._compiled: dict[tuple, Any] = {}

    @classmethod
    def for_model(cls, model: nnx.Module, *, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES) -> "Sampler":
        graphdef, _ = nnx.split(model)
        return cls(graphdef, mesh=mesh, rules=rules, max_positions=model.config.max_position_embeddings)

    def _mesh(self, state: Any) -> Mesh:
        return self.mesh if self.mesh is not None else mesh_of(state)

    def _traced(self, params: SamplingParams, mesh: Mesh, state, prompt_ids, prompt_mask, key):
        self.trace_count += 1  # runs only while tracing
        model = nnx.merge(self.graphdef, state)
        return rollout_with_stats(model, prompt_ids, prompt_mask, key, params, mesh=mesh, rules=self.rules)

    def compiled(self, state: Any, batch: int, prompt_len: int, params: SamplingParams):
        """The compiled rollout for this shape and these settings (compiling it on first use)."""
        if self.max_positions is not None and prompt_len + params.max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt length {prompt_len} + response_length {params.max_new_tokens} exceeds the model's "
                f"context of {self.max_positions} tokens; lower data.max_prompt_length or rollout.response_length"
            )
        mesh = self._mesh(state)
        cache_key = (batch, prompt_len, params.static_key(), mesh, _layout(state))
        if cache_key not in self._compiled:
            # a sampler of the same model and rules (a later trainer's, a validation run's) shares it
            self._compiled[cache_key] = programs.shared(
                (self.graphdef, self.rules, cache_key), lambda: self._compile(state, batch, prompt_len, params, mesh))
            self.compile_count += 1
        return self._compiled[cache_key]

    def _compile(self, state: Any, batch: int, prompt_len: int, params: SamplingParams, mesh: Mesh):
        rows = batch_sharding(mesh, 2, self.rules)
        rows1 = batch_sharding(mesh, 1, self.rules)
        state_shardings = jax.tree.map(lambda x: x.sharding, state)
        routes = batch_sharding(mesh, 4, self.rules) if params.record_routes else None
        out_shardings = (RolloutBatch(rows, rows, rows, rows, rows, rows1, routed_experts=routes), replicated(mesh))
        fn = jax.jit(
            functools.partial(self._traced, params.static_key(), mesh),
            in_shardings=(state_shardings, rows, rows, replicated(mesh)),
            out_shardings=out_shardings,
        )
        ids = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32, sharding=rows)
        key = jax.eval_shape(lambda: rollout_key(0))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated(mesh))
        return fn.lower(state, ids, ids, key).compile()

    def generate(
        self,
        state: Any,
        prompt_ids_BP: Any,
        prompt_mask_BP: Any,
        params: SamplingParams,
        key: jax.Array | None = None,
    ) -> RolloutBatch:
        """Sample from left-padded prompts (B, P) int32 with their mask; B must divide over data x fsdp.

        ``key`` defaults to ``rollout_key(params.seed)``; a trainer passes
        ``rollout_key(params.seed, step)`` so every step draws fresh samples.
        """
        return self.generate_with_stats(state, prompt_ids_BP, prompt_mask_BP, params, key)[0]

    def generate_with_stats(
        self,
        state: Any,
        prompt_ids_BP: Any,
        prompt_mask_BP: Any,
        params: SamplingParams,
        key: jax.Array | None = None,
    ) -> tuple[RolloutBatch, DecodeStats]:
        """``generate`` and the decode steps each loop executed (``DecodeStats``)."""
        mesh = self._mesh(state)
        B, P = prompt_ids_BP.shape
        if tuple(prompt_mask_BP.shape) != (B, P):
            raise ValueError(f"prompt mask shape {tuple(prompt_mask_BP.shape)} differs from prompt ids shape {(B, P)}")
        dp = data_parallel_size(mesh)
        if B % dp:
            raise ValueError(
                f"{B} prompts do not split over the data-parallel size {dp} (mesh data x fsdp); "
                "pad the batch with rollout.buckets.bucket_batch(B, multiple=dp)"
            )
        rows = batch_sharding(mesh, 2, self.rules)
        ids = jax.device_put(jnp.asarray(prompt_ids_BP, jnp.int32), rows)
        mask = jax.device_put(jnp.asarray(prompt_mask_BP, jnp.int32), rows)
        key = rollout_key(params.seed) if key is None else key
        key = jax.device_put(key, replicated(mesh))
        return self.compiled(state, B, P, params)(state, ids, mask, key)
