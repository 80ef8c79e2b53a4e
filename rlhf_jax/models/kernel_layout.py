"""Where the attention kernels' inputs lie on the devices, as stated by the caller that knows the mesh.

XLA cannot split a Pallas kernel over devices (Mosaic refuses to lower a sharded call: "Mosaic kernels
cannot be automatically partitioned"), and a custom call it cannot partition gets its operands gathered.
So the kernels run per device under ``shard_map``, on each device's rows and heads. The model does not
know the mesh; the program that shards its inputs does, and states it while tracing::

    with kernel_layout(mesh, rows=("data", "fsdp"), heads="tensor"):
        out = model(...)

``kernels_allowed()`` is where the attention entry points ask whether "auto" may pick a kernel: inside a
layout, or in a program for a single device (nothing to split). Elsewhere they use XLA's own paths,
which XLA partitions itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable

import jax
from jax.sharding import Mesh, PartitionSpec

from rlhf_jax.parallel.backend import compile_device_count


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """Batch rows split over mesh axes ``rows``, attention heads over ``heads`` (PartitionSpec entries)."""

    mesh: Mesh
    rows: Any = None
    heads: Any = None

    def heads_for(self, num_kv_heads: int) -> Any:
        """The heads' mesh axes when they split ``num_kv_heads`` evenly (query heads then split alike), else None."""
        axes = () if self.heads is None else (self.heads,) if isinstance(self.heads, str) else tuple(self.heads)
        return self.heads if num_kv_heads % math.prod(self.mesh.shape[a] for a in axes) == 0 else None

    def spec(self, ndim: int, heads_at: int | None = None, num_kv_heads: int = 1) -> PartitionSpec:
        """An array with rows at axis 0 and, at ``heads_at``, the heads."""
        spec = [None] * ndim
        spec[0] = self.rows
        if heads_at is not None:
            spec[heads_at] = self.heads_for(num_kv_heads)
        return PartitionSpec(*spec)


_LAYOUT: contextvars.ContextVar[KernelLayout | None] = contextvars.ContextVar("kernel_layout", default=None)


@contextlib.contextmanager
def kernel_layout(mesh: Mesh, rows: Any = None, heads: Any = None):
    """While tracing inside it, attention may run its kernels, per device, on this layout."""
    token = _LAYOUT.set(KernelLayout(mesh, rows, heads))
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def current() -> KernelLayout | None:
    return _LAYOUT.get()


def kernels_allowed() -> bool:
    """Whether "auto" may choose a kernel: a layout is stated, or the program is for one device (this process's, or
    the target's the ``plan`` command compiles for)."""
    return current() is not None or compile_device_count() == 1


def per_device(fn: Callable, in_specs: tuple, out_specs: Any) -> Callable:
    """``fn`` run on each device's block under the current layout (``fn`` itself on one device or none stated)."""
    layout = current()
    if layout is None or layout.mesh.size == 1:
        return fn
    # check_vma=False: a pallas_call does not state along which mesh axes its output varies
    return jax.shard_map(fn, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
