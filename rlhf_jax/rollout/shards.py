"""The batch axis split into per-shard blocks, and shard-local functions over those blocks.

Prompts (B), samples (N = B * n, prompt-major) and decode slots (M) all split
over the mesh axes that the logical ``batch`` axis maps to, into the same
number of equal blocks: shard d owns prompts [d B/s, (d+1) B/s), exactly the
samples of those prompts, and slots [d M/s, (d+1) M/s). Bookkeeping that
moves KV between a prompt and a slot (refill, compaction) therefore never
leaves a device; it runs under ``shard_map`` on local blocks, so XLA cannot
turn a data-dependent row index into a gather across devices.

Under a context split (``mesh.context`` > 1) the decode slots' cache is split along its length too
(``length``): each of the ``length_ways`` devices of a context group holds a contiguous block of every slot's
columns (``cache(..., split_length=True)``). The prompt cache is not: every device of the group holds its
shard's whole prompts.
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
        self.mesh, self.rules = mesh, rules
        self.batch = logical_to_spec(("batch",), rules, mesh)[0]  # None, one mesh axis or a tuple of them
        axes = () if self.batch is None else (self.batch,) if isinstance(self.batch, str) else tuple(self.batch)
        self.count = math.prod(mesh.shape[a] for a in axes)
        self.kv_heads = logical_to_spec(("kv_heads",), rules, mesh, (num_kv_heads,))[0]
        self.length = logical_to_spec(("length",), rules, mesh)[0]  # the context axis, or None
        self.length_axes = () if self.length is None else (self.length,) if isinstance(self.length, str) \
            else tuple(self.length)
        self.length_ways = math.prod(mesh.shape[a] for a in self.length_axes)

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

    def kv(self, ndim: int, at: int = 0, length_at: int | None = None) -> PartitionSpec:
        """A KV cache array: rows at axis ``at``, kv heads right after it, the length at ``length_at`` (split over
        the context axis) or whole (None)."""
        spec = [None] * ndim
        spec[at], spec[at + 1] = self.batch, self.kv_heads
        if length_at is not None:
            spec[length_at] = self.length
        return PartitionSpec(*spec)

    def cache(self, num_layers: int, at: int = 0, split_length: bool = False) -> list:
        """Per layer the specs of keys (rows, K, D, S) and values (rows, K, S, D), behind ``at`` leading axes; with
        ``split_length`` (the decode slots) S is split over the context axis."""
        ndim = 4 + at
        k_len, v_len = (at + 3, at + 2) if split_length and self.length_ways > 1 else (None, None)
        return [(self.kv(ndim, at, k_len), self.kv(ndim, at, v_len)) for _ in range(num_layers)]

    def cache_width(self, width: int) -> int:
        """``width`` rounded up to a multiple of the context split (every device holds as many cache columns)."""
        return -(-width // self.length_ways) * self.length_ways

    def length_block(self) -> jax.Array:
        """Inside ``local``: the index of this device's block of cache columns (0 without a context split)."""
        return jax.lax.axis_index(self.length_axes) if self.length_ways > 1 else 0

    def constrain(self, tree: Any, specs: Any) -> Any:
        return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, s)), tree, specs)

    def local(self, fn: Callable, in_specs: Any, out_specs: Any) -> Callable:
        """``fn`` applied to each shard's blocks (``shard_map``); it sees local shapes (size / count rows)."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)
