"""LoRA adapters on the decoder's linear projections: parameters, the low-rank path, merging.

A projection ``W`` (our layout: input dims..., output dims...) with an adapter computes
``x W + scale * (x A) B`` with ``A`` (input dims..., r) and ``B`` (r, output dims...) and
``scale = alpha / r`` (PEFT's ``lora_alpha / r``). ``A`` starts as PEFT's default
(Kaiming-uniform, bound ``1 / sqrt(fan_in)``) and ``B`` at zero, so a fresh adapter changes
nothing. The adapters live next to the weight they modify as ``<proj>_lora_a`` / ``<proj>_lora_b``
and carry its logical axes (rank axis replicated), so they shard like it; ``lora_layers`` creates them inside the
layers and computes their low-rank path. Stacked expert weights (X, in, out) get per-expert adapters ``A`` (X, in, R)
and ``B`` (X, R, out...), expert axis leading (``models/moe.py``); which modules a ``target_modules`` list adapts in
each family, and how PEFT names them, is ``models/lora_targets.py``.

``merged_state`` folds the adapters into the weights (``W + scale * A B``) and returns the plain
model's state: what the sampler and the Hugging Face export use.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlhf_jax.models.hf_import import build_abstract
from rlhf_jax.models.lora_layers import SUFFIX_A, SUFFIX_B
from rlhf_jax.models.lora_targets import ALL_LINEAR, ALL_TARGETS, PROJECTIONS, resolve_targets  # noqa: F401
from rlhf_jax.models.sharding import variable_sharding
from rlhf_jax.parallel.mesh import DEFAULT_RULES


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]  # our target names (models/lora_targets.py), in ALL_TARGETS order

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


def is_adapter(path: tuple) -> bool:
    leaf = str(path[-1])
    return leaf.endswith(SUFFIX_A) or leaf.endswith(SUFFIX_B)


HEAD_PARAMS = ("score", "score_bias")  # a head on the trunk (a value or score head), new to the checkpoint


def trained_filter(path, _value=None) -> bool:
    """An ``nnx`` filter: True for what a LoRA run trains, the adapters and a head on the trunk (PEFT's
    ``modules_to_save``; a value head on the actor, as TRL's PEFT value-head models train it)."""
    return is_adapter(path) or (len(path) == 1 and str(path[0]) in HEAD_PARAMS)


def delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``scale * A B`` in the weight's layout (input dims..., output dims...), in float32."""
    return jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1) * scale


def path_key(path: tuple) -> str:
    return "/".join(map(str, path))


def is_expert_weight(weight_path: tuple) -> bool:
    """True for a stacked expert weight (``.../experts/<proj>``), whose adapters are per expert."""
    return len(weight_path) > 1 and str(weight_path[-2]) == "experts"


def expert_delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``scale * A_x B_x`` for every expert x: A (X, in, r), B (X, r, out dims...) -> (X, in, out dims...), float32."""
    return jnp.einsum("xir,xr...->xi...", a.astype(jnp.float32), b.astype(jnp.float32)) * scale


def _deltas(flat: dict, spec: LoraSpec):
    """(weight path, float32 delta) of every adapted weight. The experts' fused gate_up adapter has outputs (2, F):
    its delta's [..., 0, :] goes to ``gate_proj``, [..., 1, :] to ``up_proj``."""
    for path, a in flat.items():
        leaf = str(path[-1])
        if not leaf.endswith(SUFFIX_A):
            continue
        name = leaf[: -len(SUFFIX_A)]
        b = flat[path[:-1] + (name + SUFFIX_B,)].get_value()
        if is_expert_weight(path):
            d = expert_delta(a.get_value(), b, spec.scale)
            if name == "gate_up_proj":
                yield path[:-1] + ("gate_proj",), d[:, :, 0]
                yield path[:-1] + ("up_proj",), d[:, :, 1]
            else:
                yield path[:-1] + (name,), d
        else:
            yield path[:-1] + (name,), delta(a.get_value(), b, spec.scale)


def narrower(dtype, other) -> jnp.dtype:
    """``other`` where it has fewer bytes than ``dtype`` (None: ``dtype``)."""
    if other is None or jnp.dtype(other).itemsize >= jnp.dtype(dtype).itemsize:
        return jnp.dtype(dtype)
    return jnp.dtype(other)


def merged_weights(state: nnx.State, spec: LoraSpec, dtype=None) -> dict[str, jax.Array]:
    """``W + scale * A B`` of every adapted weight, by ``path_key``; per expert for the experts' stacked weights. In
    the weight's dtype, or in ``dtype`` where that is narrower: the model casts a weight to its compute dtype at use,
    so a copy merged in the compute dtype gives the same products in fewer bytes (half a float32 model's). A pure
    function: jitted, it computes only the adapted weights (a jitted function that returned the untouched ones would
    copy them)."""
    flat = dict(nnx.to_flat_state(state))
    out = {}
    for path, d in _deltas(flat, spec):
        w = flat[path].get_value()
        out[path_key(path)] = (w.astype(jnp.float32) + d).astype(narrower(w.dtype, dtype))
    return out


def merged_state(state: nnx.State, spec: LoraSpec, weights: dict[str, jax.Array] | None = None) -> nnx.State:
    """The plain model's state: the adapted weights replaced by ``weights`` (default ``merged_weights``), the adapter
    parameters dropped, every other array the same object as in ``state`` (no copy)."""
    weights = merged_weights(state, spec) if weights is None else weights
    out = []
    for path, var in nnx.to_flat_state(state):
        if is_adapter(path):
            continue
        key = path_key(path)
        out.append((path, var.replace(value=weights[key]) if key in weights else var))
    return nnx.from_flat_state(out)


def plain_graphdef(cfg, task: str):
    """The graph of the same model without adapters (the sampler's, the reference's, the export's)."""
    graphdef, _ = nnx.split(build_abstract(cfg.replace(lora=None), task))
    return graphdef


def merged_model(model: nnx.Module) -> nnx.Module:
    """A plain model whose weights include the adapters (the model itself when it has none)."""
    if model.config.lora is None:
        return model
    _, state = nnx.split(model)
    return nnx.merge(plain_graphdef(model.config, model.task), merged_state(state, model.config.lora))


def with_adapters(model: nnx.Module, spec: LoraSpec, mesh, rules=None, seed: int = 0) -> nnx.Module:
    """``model`` (a plain decoder on ``mesh``) with fresh adapters on ``spec.targets``; the base arrays are kept."""
    rules = DEFAULT_RULES if rules is None else rules
    cfg = model.config
    if cfg.lora is not None:
        raise ValueError("the model has adapters already")
    lora_cfg = cfg.replace(lora=spec)
    graphdef, abstract = nnx.split(build_abstract(lora_cfg, model.task))
    _, base = nnx.split(model)
    base_flat = dict(nnx.to_flat_state(base))
    rng = np.random.default_rng(seed)
    out = []
    for path, var in nnx.to_flat_state(abstract):
        if is_adapter(path):
            shape, dtype = var.get_value().shape, var.get_value().dtype
            host = fresh_adapter(rng, shape, str(path[-1]).endswith(SUFFIX_A), var.get_metadata().get("logical_axes"))
            host = host.astype(dtype)
            value = jax.make_array_from_callback(shape, variable_sharding(var, mesh, rules), lambda idx, h=host: h[idx])
            out.append((path, var.replace(value=value)))
        else:
            out.append((path, base_flat[path]))
    return nnx.merge(graphdef, nnx.from_flat_state(out))


def fresh_adapter(rng: np.random.Generator, shape: tuple[int, ...], is_a: bool, axes=None) -> np.ndarray:
    """PEFT's initialisation on the host: A Kaiming-uniform (bound 1 / sqrt(fan_in), the fan-in of one expert for
    stacked expert adapters, whose leading logical axis is ``expert``), B zero."""
    if not is_a:
        return np.zeros(shape, np.float32)
    axes = tuple(axes) if axes else (None,) * len(shape)
    fan_in = math.prod(n for n, axis in zip(shape[:-1], axes[:-1]) if axis != "expert")
    bound = 1.0 / math.sqrt(fan_in)
    return rng.uniform(-bound, bound, shape).astype(np.float32)
