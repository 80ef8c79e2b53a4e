"""The accelerator chips the package knows: public peak figures per device (memory, bf16 FLOP/s, bandwidth).

Read by the memory plan on a real accelerator that reports no memory limit (``train/passes.free_device_memory``) and
by the ``plan`` command's rooflines (``plan/targets.py``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

GIB = 2**30
# What JAX lets a program allocate on a GPU by default: XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 of the memory
# (https://docs.jax.dev/en/latest/gpu_memory_allocation.html).
GPU_DEFAULT_MEM_FRACTION = 0.75
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


def chip_of(device: Any) -> Chip | None:
    """The table's chip of a live (or compile-only) device, by its ``device_kind``; None when unknown (CPU)."""
    kind = getattr(device, "device_kind", "")
    for chip in CHIPS.values():
        if kind in chip.device_kinds:
            return chip
    return None
