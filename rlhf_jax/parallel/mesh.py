"""Device mesh construction and the logical-axis rule table.

Parameters and activations name their dimensions logically (``embed``, ``mlp``,
``heads``, ...). A rule table maps each logical name to mesh axes; the mesh
has five named axes:

- ``data``: pure data parallelism (parameters replicated);
- ``fsdp``: data parallelism with parameters sharded along their ``embed`` dimension;
- ``expert``: expert parallelism: a Mixture-of-Experts layer's experts (their leading ``expert``
  dimension) are split over it; outside the expert weights it is data parallelism;
- ``context``: context (sequence) parallelism: the training passes' activations are split along the sequence
  (``length``) over it; attention re-splits them by heads (``models/sequence_split.py``). Parameters are
  replicated over it, as over ``data``;
- ``tensor``: tensor parallelism (attention heads, MLP width and vocabulary split).

The batch is split over ``data``, ``fsdp`` and ``expert`` together. An axis of size 1 drops out of
every partition spec, so a mesh without expert parallelism shards exactly as a three-axis one.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")  # device order: tensor innermost, then context
BATCH_AXES = ("data", "fsdp", "expert")

# logical name -> mesh axis, tuple of mesh axes, or None (replicated)
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", "context"),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("labels", None),
    ("expert", "expert"),
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def resolve_axis_sizes(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Fill in the one axis given as -1 so that the product equals ``num_devices``; check the product."""
    sizes = {axis: int(sizes.get(axis, 1)) for axis in MESH_AXES}
    unknown = [a for a, s in sizes.items() if s == -1]
    if len(unknown) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {unknown}")
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{axis}: size must be positive or -1, got {size}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if unknown:
        if num_devices % known:
            raise ValueError(
                f"mesh.{unknown[0]}=-1: the other axes ({known} devices) do not divide the {num_devices} devices"
            )
        sizes[unknown[0]] = num_devices // known
    elif known != num_devices:
        raise ValueError(
            f"mesh: data*fsdp*expert*context*tensor = {known} but {num_devices} devices are available; "
            "set one axis to -1 to use the rest"
        )
    return sizes


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, expert: int = 1, context: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, expert, context, tensor) mesh over ``devices`` (default: all devices of all processes)."""
    devices = list(devices) if devices is not None else jax.devices()
    sizes = resolve_axis_sizes({"data": data, "fsdp": fsdp, "tensor": tensor, "expert": expert, "context": context},
                               len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # a device kind without a topology-aware layout: plain order is correct
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES)


def single_device_mesh(device: jax.Device | None = None) -> Mesh:
    device = device or jax.devices()[0]
    return Mesh(np.asarray([device]).reshape((1,) * len(MESH_AXES)), MESH_AXES)


def _mesh_axes_for(name: str | None, rules: Rules) -> tuple[str, ...]:
    if name is None:
        return ()
    for logical, target in rules:
        if logical == name:
            if target is None:
                return ()
            return (target,) if isinstance(target, str) else tuple(target)
    return ()


def logical_to_spec(
    axes: Iterable[str | None], rules: Rules = DEFAULT_RULES, mesh: Mesh | None = None, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """PartitionSpec for logical ``axes``; a dimension whose size the mesh axes do not divide is replicated."""
    used: set[str] = set()
    spec = []
    for i, name in enumerate(axes):
        targets = tuple(a for a in _mesh_axes_for(name, rules) if a not in used)
        if mesh is not None:
            targets = tuple(a for a in targets if mesh.shape[a] > 1)
            if shape is not None and targets:
                ways = math.prod(mesh.shape[a] for a in targets)
                if shape[i] % ways:
                    log.info("dimension %s of size %d is not divisible by %s=%d: replicated", name, shape[i], targets, ways)
                    targets = ()
        used.update(targets)
        spec.append(targets[0] if len(targets) == 1 else (targets or None))
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, axes: Iterable[str | None], shape: Sequence[int] | None = None, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, shape))


def batch_sharding(mesh: Mesh, ndim: int, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Sharding for a batch-major array: dim 0 over (data, fsdp), the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)
