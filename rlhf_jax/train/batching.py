"""Splitting a batch into mini-batches that each keep rows on every shard (the host <-> mesh transfers are in
``rlhf_jax.parallel.hosts``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlhf_jax.parallel import batch_sharding
from rlhf_jax.train.steps import split_micro


@functools.lru_cache(maxsize=64)
def _splitter(mesh: Mesh, num: int, ndims: tuple[tuple[str, int], ...]):
    out = tuple({k: batch_sharding(mesh, nd) for k, nd in ndims} for _ in range(num))

    def split(batch, perm):
        shuffled = {k: jnp.take(v, perm, axis=0) for k, v in batch.items()}
        parts = split_micro(shuffled, num)
        return tuple({k: v[i] for k, v in parts.items()} for i in range(num))

    return jax.jit(split, out_shardings=out)


def mini_batches(mesh: Mesh, batch: dict[str, jax.Array], num: int, perm: np.ndarray | None = None) -> tuple[dict, ...]:
    """Split a batch into ``num`` mini-batches (after permuting rows by ``perm``), each batch-sharded.

    Mini-batch i takes every ``num``-th row starting at i, so each keeps rows on every shard.
    """
    n = next(iter(batch.values())).shape[0]
    if n % num:
        raise ValueError(f"{n} rows do not split into {num} mini-batches")
    perm = np.arange(n) if perm is None else np.asarray(perm)
    ndims = tuple(sorted((k, v.ndim) for k, v in batch.items()))
    return _splitter(mesh, num, ndims)(batch, jnp.asarray(perm, jnp.int32))
