"""Moving batches between each process's host memory and the global mesh.

Each process holds its own rows (its shard of the prompts and their samples); ``to_global`` assembles those into
one global array sharded over the batch axes, ``to_local`` reads back this process's rows. With one process they
are a ``device_put`` and a ``device_get``.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from rlhf_jax.parallel import groups
from rlhf_jax.parallel.mesh import batch_sharding


def to_global(mesh: Mesh, local: np.ndarray) -> jax.Array:
    """Process-local rows -> a global batch-sharded array (rows of process p form block p)."""
    sharding = batch_sharding(mesh, np.ndim(local))
    if groups.process_count() == 1:
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
    """The whole global array on every process of the group (for metrics over all processes' rows)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    return groups.allgather(x, tiled=True)


def all_rows(local) -> np.ndarray:
    """Every process's rows of a process-local host array, in process order (this process's own when it is alone)."""
    local = np.asarray(local)
    return local if groups.process_count() == 1 else groups.allgather(local, tiled=True)


def sum_over_processes(values: np.ndarray) -> np.ndarray:
    """Element-wise sum of a same-shaped host array over the processes of the group."""
    if groups.process_count() == 1:
        return np.asarray(values)
    return groups.allgather(np.asarray(values)).sum(axis=0)
