"""LoRA adapters in PEFT's layout: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT stores, for each adapted ``nn.Linear`` named ``<module>`` of the HF model,
``base_model.model.<module>.lora_A.weight`` (r, in_features) and ``...lora_B.weight``
(out_features, r). Ours are ``A`` (input dims..., r) and ``B`` (r, output dims...), so
``A = lora_A.T`` and ``B = lora_B.T``, reshaped to our head-split dims.
"""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
from flax import nnx

from rlhf_jax.models import lora
from rlhf_jax.models.hf_names import mapping_for
from rlhf_jax.models.safetensors_io import LazyFile, save_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
ADAPTER_DIR = "lora_adapter"  # the adapter's directory inside an exported HF directory


def _module_name(weight_path: tuple, cfg) -> str:
    """The HF module name of one of our projection weights (``model.layers.0.self_attn.q_proj``)."""
    name = mapping_for(weight_path, cfg).hf_name
    if not name.endswith(".weight"):
        raise ValueError(f"{name} is not a linear weight")
    return name[: -len(".weight")]


def _adapted(state: nnx.State):
    """(weight path, A variable, B variable) of every adapter in ``state``."""
    flat = dict(nnx.to_flat_state(state))
    for path, a in flat.items():
        leaf = str(path[-1])
        if leaf.endswith(lora.SUFFIX_A):
            proj = leaf[: -len(lora.SUFFIX_A)]
            yield path[:-1] + (proj,), a, flat[path[:-1] + (proj + lora.SUFFIX_B,)]


def read_config(path: str) -> dict:
    file = os.path.join(os.path.expanduser(path), CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} is not a PEFT adapter directory (no {CONFIG_FILE})")
    with open(file) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, supported in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False)):
        if config.get(key, supported) != supported:
            raise ValueError(f"{file}: {key}={config[key]} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{file}: per-module rank_pattern / alpha_pattern are not supported")
    return config


def spec_from_config(config: dict) -> lora.LoraSpec:
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets != lora.ALL_LINEAR:
        raise ValueError(f"adapter target_modules {targets!r}: regular expressions are not supported")
    return lora.LoraSpec(int(config["r"]), float(config["lora_alpha"]),
                         lora.resolve_targets(targets, key=f"{CONFIG_FILE} target_modules"))


def save_adapter(model: nnx.Module, out_dir: str, base_model: str | None = None) -> str:
    """Write ``model``'s adapters as a PEFT adapter directory (process 0 writes)."""
    from rlhf_jax.models.hf_export import to_host

    spec = model.config.lora
    tensors = {}
    for weight_path, a, b in _adapted(nnx.state(model, nnx.Param)):
        module = _module_name(weight_path, model.config)
        a_host, b_host = to_host(a.get_value()), to_host(b.get_value())
        tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a_host.reshape(-1, spec.rank).T)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b_host.reshape(spec.rank, -1).T)
    if jax.process_index() != 0:
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "target_modules": list(spec.targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "inference_mode": True, "base_model_name_or_path": base_model}
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def load_adapter(model: nnx.Module, path: str) -> nnx.Module:
    """``model`` (with adapters of the same rank, alpha and targets) with the adapter weights of a PEFT directory."""
    path = os.path.expanduser(path)
    found = spec_from_config(read_config(path))
    spec = model.config.lora
    if (found.rank, found.alpha, found.targets) != (spec.rank, spec.alpha, spec.targets):
        raise ValueError(f"{path}: adapter has r={found.rank}, lora_alpha={found.alpha:g}, target_modules="
                         f"{list(found.targets)}; the run asks for lora_rank={spec.rank}, lora_alpha={spec.alpha:g}, "
                         f"target_modules={list(spec.targets)}")
    file = LazyFile(os.path.join(path, WEIGHTS_FILE))
    names = set(file.keys())
    graphdef, state = nnx.split(model)
    used = set()
    for weight_path, a, b in _adapted(state):
        module = _module_name(weight_path, model.config)
        for var, name, transpose_shape in ((a, f"{PREFIX}{module}.lora_A.weight", True),
                                           (b, f"{PREFIX}{module}.lora_B.weight", False)):
            if name not in names:
                raise ValueError(f"{path}: {WEIGHTS_FILE} lacks {name}")
            value = var.get_value()
            host = np.asarray(file.get(name)).T
            if host.size != math.prod(value.shape):
                raise ValueError(f"{path}: {name} has shape {host.T.shape}, the model needs {value.shape} elements")
            host = host.reshape(value.shape).astype(value.dtype)
            var.set_value(jax.make_array_from_callback(value.shape, value.sharding, lambda idx, h=host: h[idx]))
            used.add(name)
    extra = sorted(names - used)
    if extra:
        raise ValueError(f"{path}: {WEIGHTS_FILE} holds tensors the model has no place for: {extra[:4]}")
    return nnx.merge(graphdef, state)
