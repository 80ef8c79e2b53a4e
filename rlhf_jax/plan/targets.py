"""Hardware the plan compiles for: a table of chips (public figures) and named topologies -> compile-only devices.

TPU slices come from libtpu's topology descriptions (``jax.experimental.topologies.get_topology_desc``), GPU nodes
from the CUDA plugin and a GPU target description (a ``GpuTargetConfig`` text proto, ``gpu_specs/``); neither needs
the hardware, so every program of a run can be compiled here and XLA's memory and cost analyses read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rlhf_jax.parallel.chips import CHIPS, Chip

SPECS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")


@dataclasses.dataclass(frozen=True)
class Target:
    """A named slice or node: ``chips`` devices of one chip over ``hosts`` hosts."""

    name: str
    chip: Chip
    platform: str  # "tpu" or "cuda"
    chips: int
    hosts: int
    topology: str  # libtpu's topology name, or the GPU topology "slices x hosts x devices per host"
    spec_file: str | None = None  # GPU: the GpuTargetConfig text proto in gpu_specs/

    @property
    def backend(self) -> str:
        return "gpu" if self.platform == "cuda" else self.platform


def _tpu(name: str, chip: str, topology: str, chips: int, hosts: int) -> Target:
    return Target(name, CHIPS[chip], "tpu", chips, hosts, f"{chip}:{topology}")


def _gpu(name: str, chip: str, gpus: int) -> Target:
    return Target(name, CHIPS[chip], "cuda", gpus, 1, f"1x1x{gpus}", f"{chip}_sxm.txtpb")


# TPU names count TensorCores for v5p (v5p-8 = 4 chips, one host) and chips for v5e / v6e (one host of 8).
TARGETS = {t.name: t for t in (
    _tpu("v5e-8", "v5e", "2x4", 8, 1),
    _tpu("v5p-8", "v5p", "2x2x1", 4, 1),
    _tpu("v5p-16", "v5p", "2x2x2", 8, 2),
    _tpu("v5p-32", "v5p", "2x2x4", 16, 4),
    _tpu("v6e-8", "v6e", "2x4", 8, 1),
    _gpu("h100-1", "h100", 1),
    _gpu("h100-8", "h100", 8),
    _gpu("h200-8", "h200", 8),
)}


def target(name: str) -> Target:
    """The target called ``name``; an unknown name is a one-line error listing the known ones."""
    if name not in TARGETS:
        raise ValueError(f"unknown topology {name!r}; known: {', '.join(TARGETS)} (or 'local': the devices JAX sees)")
    return TARGETS[name]


def _tpu_environment(t: Target) -> None:
    """libtpu looks for a TPU VM's metadata when it loads; say there is none (it otherwise prints warnings). It also
    takes a lock file that only one process may hold: compiling needs no TPU, so several processes may compile."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", t.name)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_WORKER_ID", "0")


def target_devices(t: Target) -> list[Any]:
    """Compile-only devices of ``t`` (no hardware needed); a missing compiler is a one-line error."""
    from jax.experimental import topologies

    if t.platform == "tpu":
        _tpu_environment(t)
        per_host = t.chips // t.hosts
        bounds = (2, per_host // 2, 1) if per_host >= 2 else (1, 1, 1)
        try:
            return list(topologies.get_topology_desc(topology_name=t.topology, platform="tpu",
                                                     chips_per_host_bounds=bounds).devices)
        except RuntimeError as e:
            raise RuntimeError(f"cannot compile for {t.name}: {str(e).splitlines()[0]} (pip install "
                               "'rlhf_jax[accelerators]' installs libtpu)") from None
    # No driver on this machine: the plugin's CUDA version check would refuse to load.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    with open(os.path.join(SPECS_DIR, t.spec_file)) as f:
        spec = f.read()
    try:
        return list(topologies.get_topology_desc(platform="cuda", topology=t.topology, target_config=spec).devices)
    except (NotImplementedError, RuntimeError) as e:
        raise RuntimeError(f"cannot compile for {t.name}: {str(e).splitlines()[0]} (pip install "
                           "'rlhf_jax[accelerators]' installs the CUDA plugin and ptxas)") from None
