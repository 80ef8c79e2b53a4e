"""Splitting a batch into mini-batches that each keep rows on every shard (the host <-> mesh transfers are in
``rlhf_jax.parallel.hosts``)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlhf_jax.parallel import batch_sharding
from rlhf_jax.train.steps import split_micro


@functools.lru_cache(maxsize=64)
def _splitter(mesh: Mesh, num: int, treedef, ndims: tuple[int, ...]):
    shardings = jax.tree.unflatten(treedef, [batch_sharding(mesh, nd) for nd in ndims])

    def split(batch, perm):
        parts = split_micro(jax.tree.map(lambda v: jnp.take(v, perm, axis=0), batch), num)
        return tuple(jax.tree.map(lambda v: v[i], parts) for i in range(num))

    return jax.jit(split, out_shardings=(shardings,) * num)


def mini_batches(mesh: Mesh, batch: Any, num: int, perm: np.ndarray | None = None) -> tuple[Any, ...]:
    """Split a batch (a TrainBatch or a dict of arrays) into ``num`` mini-batches (after permuting rows by
    ``perm``), each batch-sharded.

    Mini-batch i takes every ``num``-th row starting at i, so each keeps rows on every shard.
    """
    leaves, treedef = jax.tree.flatten(batch)
    n = leaves[0].shape[0]
    if n % num:
        raise ValueError(f"{n} rows do not split into {num} mini-batches")
    perm = np.arange(n) if perm is None else np.asarray(perm)
    return _splitter(mesh, num, treedef, tuple(x.ndim for x in leaves))(batch, jnp.asarray(perm, jnp.int32))
