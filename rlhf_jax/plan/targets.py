"""Hardware the plan compiles for: a table of chips (public figures) and named topologies -> compile-only devices.

TPU slices come from libtpu's topology descriptions (``jax.experimental.topologies.get_topology_desc``), GPU nodes
from the CUDA plugin and a GPU target description (a ``GpuTargetConfig`` text proto, ``gpu_specs/``); neither needs
the hardware, so every program of a run can be compiled here and XLA's memory and cost analyses read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

GIB = 2**30
# What JAX lets a program allocate on a GPU by default: XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 of the memory
# (https://docs.jax.dev/en/latest/gpu_memory_allocation.html).
GPU_DEFAULT_MEM_FRACTION = 0.75
SPECS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")


@dataclasses.dataclass(frozen=True)
class Chip:
    """One device as JAX sees it (a TPU chip, one GPU): public peak figures."""

    name: str
    hbm_bytes: int  # device memory
    peak_flops: float  # dense bfloat16 FLOP/s
    hbm_bytes_per_s: float  # memory bandwidth
    device_kinds: tuple[str, ...] = ()  # jax ``device.device_kind`` strings of this chip

    def usable_bytes(self, platform: str) -> int:
        """The memory a JAX program may allocate on one device: on GPU the client's memory fraction of it."""
        if platform in ("cuda", "gpu"):
            fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_DEFAULT_MEM_FRACTION))
            return int(self.hbm_bytes * fraction)
        return self.hbm_bytes


CHIPS = {
    # https://cloud.google.com/tpu/docs/v5e ("Peak compute per chip (bf16) 197 TFLOPs, HBM2 capacity 16 GiB,
    # HBM2 bandwidth 819 GBps")
    "v5e": Chip("TPU v5e", 16 * GIB, 197e12, 819e9, ("TPU v5 lite", "TPU v5e")),
    # https://cloud.google.com/tpu/docs/v5p ("Peak compute per chip (bf16) 459 TFLOPs, HBM2e capacity 95 GiB,
    # HBM2e bandwidth 2765 GBps"); one v5p chip (two TensorCores, megacore) is one JAX device
    "v5p": Chip("TPU v5p", 95 * GIB, 459e12, 2765e9, ("TPU v5", "TPU v5p")),
    # https://cloud.google.com/tpu/docs/v6e ("Peak compute per chip (bf16) 918 TFLOPs, HBM capacity 32 GiB,
    # HBM bandwidth 1640 GBps")
    "v6e": Chip("TPU v6e", 32 * GIB, 918e12, 1640e9, ("TPU v6 lite", "TPU v6e")),
    # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 80 GB HBM3, 3.35 TB/s, BF16 Tensor Core 1,979
    # TFLOPS with sparsity = 989 dense); the memory is what the device reports (xla gpu_specs/h100_sxm.txtpb)
    "h100": Chip("H100 SXM", 84978434048, 989e12, 3.35e12, ("NVIDIA H100 80GB HBM3", "NVIDIA H100")),
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with
    # sparsity = 989 dense); 143771 MiB as the device reports it
    "h200": Chip("H200 SXM", 143771 * 2**20, 989e12, 4.8e12, ("NVIDIA H200",)),
}


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


def chip_of(device: Any) -> Chip | None:
    """The table's chip of a live (or compile-only) device, by its ``device_kind``; None when unknown (CPU)."""
    kind = getattr(device, "device_kind", "")
    for chip in CHIPS.values():
        if kind in chip.device_kinds:
            return chip
    return None
