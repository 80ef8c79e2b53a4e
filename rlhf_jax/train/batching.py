"""Moving rollout batches between hosts and the mesh, and splitting them into mini-batches.

Each process holds its own rows (its shard of the prompts and their samples);
``to_global`` assembles those into one global array sharded over the batch axes,
``to_local`` reads back this process's rows. With one process they are a
``device_put`` and a ``device_get``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlhf_jax.parallel import batch_sharding
from rlhf_jax.train.steps import split_micro


def to_global(mesh: Mesh, local: np.ndarray) -> jax.Array:
    """Process-local rows -> a global batch-sharded array (rows of process p form block p)."""
    sharding = batch_sharding(mesh, np.ndim(local))
    if jax.process_count() == 1:
        return jax.device_put(np.asarray(local), sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(local))


def to_local(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in order."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    pieces = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0
        pieces.setdefault(start, np.asarray(shard.data))
    return np.concatenate([pieces[k] for k in sorted(pieces)], axis=0)


def gather_all(x) -> np.ndarray:
    """The whole global array on every process (for metrics over all processes' rows)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def sum_over_processes(values: np.ndarray) -> np.ndarray:
    """Element-wise sum of a same-shaped host array over all processes."""
    if jax.process_count() == 1:
        return np.asarray(values)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(values))).sum(axis=0)


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
