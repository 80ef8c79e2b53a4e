"""LoRA adapters on the decoder's linear projections: parameters, the low-rank path, merging.

A projection ``W`` (our layout: input dims..., output dims...) with an adapter computes
``x W + scale * (x A) B`` with ``A`` (input dims..., r) and ``B`` (r, output dims...) and
``scale = alpha / r`` (PEFT's ``lora_alpha / r``). ``A`` starts as PEFT's default
(Kaiming-uniform, bound ``1 / sqrt(fan_in)``) and ``B`` at zero, so a fresh adapter changes
nothing. The adapters live next to the weight they modify as ``<proj>_lora_a`` / ``<proj>_lora_b``
and carry its logical axes (rank axis replicated), so they shard like it; ``lora_layers`` creates them inside the
layers and computes their low-rank path.

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
from rlhf_jax.models.sharding import variable_sharding
from rlhf_jax.parallel.mesh import DEFAULT_RULES

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]  # projection names, a subset of PROJECTIONS

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


def resolve_targets(target_modules, key: str = "target_modules") -> tuple[str, ...]:
    """``all-linear`` (every projection of the decoder layers, PEFT's meaning: not the output head) or a list of
    projection names; an unknown name is an error naming ``key``."""
    names = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules or ())
    if not names:
        raise ValueError(f"{key} is empty: give all-linear or projection names ({', '.join(PROJECTIONS)})")
    if ALL_LINEAR in names:
        if len(names) > 1:
            raise ValueError(f"{key}={list(names)}: all-linear stands alone")
        return PROJECTIONS
    unknown = [n for n in names if n not in PROJECTIONS]
    if unknown:
        raise ValueError(f"{key}: no module named {', '.join(map(repr, unknown))} in the decoder; "
                         f"choose all-linear or from {', '.join(PROJECTIONS)}")
    return tuple(n for n in PROJECTIONS if n in names)


def is_adapter(path: tuple) -> bool:
    leaf = str(path[-1])
    return leaf.endswith(SUFFIX_A) or leaf.endswith(SUFFIX_B)


def adapter_filter(path, _value=None) -> bool:
    """An ``nnx`` filter: True for adapter parameters (what a LoRA run trains)."""
    return is_adapter(path)


def delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``scale * A B`` in the weight's layout (input dims..., output dims...), in float32."""
    return jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1) * scale


def path_key(path: tuple) -> str:
    return "/".join(map(str, path))


def merged_weights(state: nnx.State, spec: LoraSpec) -> dict[str, jax.Array]:
    """``W + scale * A B`` (in the weight's dtype) of every adapted weight, by ``path_key``. A pure function: jitted,
    it computes only the adapted weights (a jitted function that returned the untouched ones would copy them)."""
    flat = dict(nnx.to_flat_state(state))
    out = {}
    for path, var in flat.items():
        a = flat.get(path[:-1] + (str(path[-1]) + SUFFIX_A,))
        if a is not None and not is_adapter(path):
            b = flat[path[:-1] + (str(path[-1]) + SUFFIX_B,)]
            w = var.get_value()
            out[path_key(path)] = (w.astype(jnp.float32) + delta(a.get_value(), b.get_value(), spec.scale)).astype(w.dtype)
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
    if cfg.num_experts:
        raise ValueError("LoRA on Mixture-of-Experts models is not supported (actor_rollout_ref.model.lora_rank)")
    lora_cfg = cfg.replace(lora=spec)
    graphdef, abstract = nnx.split(build_abstract(lora_cfg, model.task))
    _, base = nnx.split(model)
    base_flat = dict(nnx.to_flat_state(base))
    rng = np.random.default_rng(seed)
    out = []
    for path, var in nnx.to_flat_state(abstract):
        if is_adapter(path):
            shape, dtype = var.get_value().shape, var.get_value().dtype
            host = fresh_adapter(rng, shape, str(path[-1]).endswith(SUFFIX_A)).astype(dtype)
            value = jax.make_array_from_callback(shape, variable_sharding(var, mesh, rules), lambda idx, h=host: h[idx])
            out.append((path, var.replace(value=value)))
        else:
            out.append((path, base_flat[path]))
    return nnx.merge(graphdef, nnx.from_flat_state(out))


def fresh_adapter(rng: np.random.Generator, shape: tuple[int, ...], is_a: bool) -> np.ndarray:
    """PEFT's initialisation on the host: A Kaiming-uniform (bound 1 / sqrt(fan_in)), B zero."""
    if not is_a:
        return np.zeros(shape, np.float32)
    bound = 1.0 / math.sqrt(math.prod(shape[:-1]))
    return rng.uniform(-bound, bound, shape).astype(np.float32)
