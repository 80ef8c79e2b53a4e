"""Mesh construction, logical-axis sharding rules and multi-host initialisation."""

from rlhf_jax.parallel.mesh import (
    BATCH_AXES,
    DEFAULT_RULES,
    MESH_AXES,
    batch_sharding,
    data_parallel_size,
    logical_to_spec,
    make_mesh,
    named_sharding,
    replicated,
    resolve_axis_sizes,
    single_device_mesh,
)

__all__ = [
    "BATCH_AXES",
    "DEFAULT_RULES",
    "MESH_AXES",
    "batch_sharding",
    "data_parallel_size",
    "logical_to_spec",
    "make_mesh",
    "named_sharding",
    "replicated",
    "resolve_axis_sizes",
    "single_device_mesh",
]
