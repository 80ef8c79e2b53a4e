"""The processes this process works with: every process of the run, or its group when the run splits its
processes between sampling and training (see parallel/handoff.py for what moves between groups).

Code that asks "how many processes share this work, which one am I, who writes the log" asks this module, not
``jax.process_count()`` / ``jax.process_index()``: in a run of one group the answers are the same; in a split run
they are the group's, and the host collectives here (``allgather``) run over the group's processes only, so each
group can run them while the other group does something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Process indices (ascending) that share one part of the run."""

    processes: tuple[int, ...]
    name: str = "all"

    @property
    def count(self) -> int:
        return len(self.processes)

    @property
    def index(self) -> int:
        """This process's position in the group."""
        return self.processes.index(jax.process_index())

    @property
    def is_first(self) -> bool:
        """This process writes what the group writes once (logs, checkpoint metadata, exports)."""
        return jax.process_index() == self.processes[0]

    def devices(self) -> list:
        """The group's devices in id order."""
        members = set(self.processes)
        return sorted((d for d in jax.devices() if d.process_index in members), key=lambda d: d.id)

    def spans_the_run(self) -> bool:
        return self.count == jax.process_count()


_JOINED: ProcessGroup | None = None


def everyone() -> ProcessGroup:
    return ProcessGroup(tuple(range(jax.process_count())))


def current() -> ProcessGroup:
    """The group of this process: every process unless :func:`join` said otherwise."""
    return _JOINED if _JOINED is not None else everyone()


def join(group: ProcessGroup | None) -> None:
    """From now on this process works with ``group`` (None: every process again)."""
    global _JOINED
    if group is not None and jax.process_index() not in group.processes:
        raise ValueError(f"process {jax.process_index()} cannot join the {group.name} group {list(group.processes)}")
    _JOINED = group


def split(num_processes: int, rollout_processes: int) -> tuple[ProcessGroup, ProcessGroup]:
    """(training, sampling): the last ``rollout_processes`` processes sample, the others train (process 0, which
    hosts the distributed runtime's coordination service, always trains)."""
    if not 0 < rollout_processes < num_processes:
        raise ValueError(f"{rollout_processes} sampling processes of {num_processes}: at least one process must "
                         "sample and one train")
    cut = num_processes - rollout_processes
    return (ProcessGroup(tuple(range(cut)), "training"), ProcessGroup(tuple(range(cut, num_processes)), "sampling"))


def process_count() -> int:
    return current().count


def process_index() -> int:
    return current().index


def device_count() -> int:
    group = current()
    return jax.device_count() if group.spans_the_run() else len(group.devices())


def allgather(x: Any, tiled: bool = False) -> np.ndarray:
    """``x`` of every process of the group, stacked (``tiled``: concatenated along the first axis) in group order;
    a global array (on a mesh of the group's devices) is read whole."""
    group = current()
    if group.spans_the_run():
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=tiled))
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        whole = jax.jit(lambda a: a, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))(x)
        return np.asarray(whole.addressable_data(0))
    local = np.asarray(x)
    # one device per process: each contributes its value as one block of the first axis
    firsts = [min((d for d in group.devices() if d.process_index == p), key=lambda d: d.id) for p in group.processes]
    mesh = Mesh(np.array(firsts), ("processes",))
    block = local if tiled else local[None]
    stacked = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("processes")), block)
    whole = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))(stacked)
    return np.asarray(whole.addressable_data(0))
