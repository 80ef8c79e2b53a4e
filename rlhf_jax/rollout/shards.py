"""The batch axis split into per-shard blocks, and shard-local functions over those blocks.

Prompts (B), samples (N = B * n, prompt-major) and decode slots (M) all split
over the mesh axes that the logical ``batch`` axis maps to, into the same
number of equal blocks: shard d owns prompts [d B/s, (d+1) B/s), exactly the
samples of those prompts, and slots [d M/s, (d+1) M/s). Bookkeeping that
moves KV between a prompt and a slot (refill, compaction) therefore never
leaves a device; it runs under ``shard_map`` on local blocks, so XLA cannot
turn a data-dependent row index into a gather across devices.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhf_jax.parallel.mesh import Rules, logical_to_spec


class BatchShards:
    """Where the batch axis lives on ``mesh``: the partition specs of batch-major arrays and of KV caches."""

    def __init__(self, mesh: Mesh, rules: Rules, num_kv_heads: int):
        self.mesh = mesh
        self.batch = logical_to_spec(("batch",), rules, mesh)[0]  # None, one mesh axis or a tuple of them
        axes = () if self.batch is None else (self.batch,) if isinstance(self.batch, str) else tuple(self.batch)
        self.count = math.prod(mesh.shape[a] for a in axes)
        self.kv_heads = logical_to_spec(("kv_heads",), rules, mesh, (num_kv_heads,))[0]

    @property
    def platform(self) -> str:
        return self.mesh.devices.flat[0].platform

    def per_shard(self, size: int, what: str) -> int:
        if size % self.count:
            raise ValueError(f"{size} {what} do not split over the {self.count} data-parallel shards (mesh data x fsdp)")
        return size // self.count

    def rows(self, ndim: int, at: int = 0) -> PartitionSpec:
        """A batch-major array: axis ``at`` split over the shards, the rest replicated."""
        return PartitionSpec(*[self.batch if i == at else None for i in range(ndim)])

    def kv(self, ndim: int, at: int = 0) -> PartitionSpec:
        """A KV cache array: rows at axis ``at``, kv heads right after it."""
        spec = [None] * ndim
        spec[at], spec[at + 1] = self.batch, self.kv_heads
        return PartitionSpec(*spec)

    def cache(self, num_layers: int, at: int = 0) -> list:
        ndim = 4 + at
        return [(self.kv(ndim, at), self.kv(ndim, at)) for _ in range(num_layers)]

    def constrain(self, tree: Any, specs: Any) -> Any:
        return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, s)), tree, specs)

    def local(self, fn: Callable, in_specs: Any, out_specs: Any) -> Callable:
        """``fn`` applied to each shard's blocks (``shard_map``); it sees local shapes (size / count rows)."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)
