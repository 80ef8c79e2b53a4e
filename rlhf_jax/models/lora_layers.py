"""LoRA inside the decoder's layers: a projection's adapter parameters and its low-rank path ``scale * (x A) B``.

The layers call these while they are built and applied; specs, merging and adapting a whole model are in
``models/lora.py`` (which builds models, so it sits above the layers).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from rlhf_jax.models.lora_targets import rank_of

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


def add_adapters(module: nnx.Module, cfg, rngs: nnx.Rngs | None, shapes: dict) -> None:
    """Create the adapter parameters of ``module``'s targeted projections.

    ``shapes``: projection name -> (input shape, output shape, input logical axes, output logical axes).
    """
    spec = cfg.lora
    if spec is None:
        return
    for name in spec.targets:
        if name not in shapes:
            continue
        in_shape, out_shape, in_axes, out_axes = shapes[name]
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        a = jax.random.uniform(rngs.params(), in_shape + (spec.rank,), cfg.param_dtype, -bound, bound)
        setattr(module, name + SUFFIX_A, nnx.Param(a, logical_axes=tuple(in_axes) + (None,)))
        b = jnp.zeros((spec.rank,) + out_shape, cfg.param_dtype)
        setattr(module, name + SUFFIX_B, nnx.Param(b, logical_axes=(None,) + tuple(out_axes)))


def add_expert_adapters(module: nnx.Module, cfg, rngs: nnx.Rngs | None, shapes: dict) -> None:
    """Per-expert adapters of ``module``'s targeted stacked expert projections: ``A`` (X, in, R) and ``B``
    (X, R, out dims...), the expert axis leading as on the weights (so expert parallelism shards them alike).

    ``shapes``: target name -> (attribute name, X, in size, output shape, in logical axis, output logical axes).
    """
    spec = cfg.lora
    if spec is None:
        return
    for target, (name, X, fan_in, out_shape, in_axis, out_axes) in shapes.items():
        if target not in spec.targets:
            continue
        rank, bound = rank_of(target, spec.rank), 1.0 / math.sqrt(fan_in)  # PEFT's bound: per expert's fan-in
        a = jax.random.uniform(rngs.params(), (X, fan_in, rank), cfg.param_dtype, -bound, bound)
        setattr(module, name + SUFFIX_A, nnx.Param(a, logical_axes=("expert", in_axis, None)))
        b = jnp.zeros((X, rank) + tuple(out_shape), cfg.param_dtype)
        setattr(module, name + SUFFIX_B, nnx.Param(b, logical_axes=("expert", None) + tuple(out_axes)))


def expert_factors(module: nnx.Module, cfg, name: str) -> tuple[jax.Array, jax.Array] | None:
    """(A, B) of expert projection ``name`` in the compute dtype, None without an adapter."""
    if cfg.lora is None or not hasattr(module, name + SUFFIX_A):
        return None
    dt = cfg.dtype
    return getattr(module, name + SUFFIX_A)[...].astype(dt), getattr(module, name + SUFFIX_B)[...].astype(dt)


def low_rank(module: nnx.Module, cfg, name: str, x: jax.Array, in_ndim: int,
             in_shape: tuple[int, ...] | None = None) -> jax.Array | None:
    """``scale * (x A) B`` of projection ``name`` (None when it has no adapter); ``x`` ends in its ``in_ndim`` input
    dims. ``in_shape``: A's input dims flattened to it first (``x`` flattened the same way)."""
    if cfg.lora is None or name not in cfg.lora.targets:
        return None
    dt = cfg.dtype
    a, b = getattr(module, name + SUFFIX_A)[...].astype(dt), getattr(module, name + SUFFIX_B)[...].astype(dt)
    if in_shape is not None:
        a = a.reshape(in_shape + (a.shape[-1],))
    h = jnp.tensordot(x, a, axes=in_ndim)
    return jnp.tensordot(h, b, axes=1) * jnp.asarray(cfg.lora.scale, dt)
