"""LoRA adapters in PEFT's layout: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT stores, for each adapted ``nn.Linear`` named ``<module>`` of the HF model,
``base_model.model.<module>.lora_A.weight`` (r, in_features) and ``...lora_B.weight``
(out_features, r). Ours are ``A`` (input dims..., r) and ``B`` (r, output dims...), so
``A = lora_A.T`` and ``B = lora_B.T``, reshaped to our head-split dims.

Adapted expert parameters and the MoE router go to ``target_parameters`` (with the fused gate_up_proj's rank and
alpha patterns), and a stacked expert adapter is one ``lora_A`` (R X, in) / ``lora_B`` (out, R X) pair under
``mlp.experts``: ``models/lora_targets.py`` has the layout and the names.
"""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
from flax import nnx

from rlhf_jax.parallel import groups
from rlhf_jax.models import lora
from rlhf_jax.models.hf_names import mapping_for
from rlhf_jax.models.lora_targets import ALL_TARGETS, EXPERT_DOWN, EXPERT_GATE_UP, PEFT_PARAMETERS, resolve_targets
from rlhf_jax.models.safetensors_io import LazyFile, save_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
ADAPTER_DIR = "lora_adapter"  # the adapter's directory inside an exported HF directory
GATE_UP_PATTERN = r".*\.gate_up_proj"  # PEFT's rank / alpha pattern key for the fused expert gate_up_proj


def _module_name(weight_path: tuple, cfg) -> str:
    """The HF module name of one of our projection weights (``model.layers.0.self_attn.q_proj``)."""
    name = mapping_for(weight_path, cfg).hf_name
    if not name.endswith(".weight"):
        raise ValueError(f"{name} is not a linear weight")
    return name[: -len(".weight")]


def _peft_module(weight_path: tuple, spec, cfg) -> str:
    """Where PEFT keeps the adapter of ``weight_path``: the module's name, or for a stacked expert parameter the
    experts module's, inside ``base_layer`` for gate_up_proj when down_proj's wrapper encloses it."""
    if not lora.is_expert_weight(weight_path):
        return _module_name(weight_path, cfg)
    module = ".".join(map(str, weight_path[:-1]))
    return module + ".base_layer" if weight_path[-1] == "gate_up_proj" and EXPERT_DOWN in spec.targets else module


def _to_peft(a: np.ndarray, b: np.ndarray, expert: bool) -> tuple[np.ndarray, np.ndarray]:
    """(lora_A, lora_B) from our A, B; experts: A (X, in, R) -> (R X, in) expert-major rows, B (X, R, out...) ->
    (out, R X) rank-major columns."""
    if expert:
        X, _, R = a.shape
        return a.transpose(0, 2, 1).reshape(X * R, -1), b.reshape(X, R, -1).transpose(2, 1, 0).reshape(-1, R * X)
    R = a.shape[-1]
    return a.reshape(-1, R).T, b.reshape(R, -1).T


def _from_peft(lora_a: np.ndarray, lora_b: np.ndarray, a_shape, b_shape, expert: bool):
    """Our (A, B) of shapes ``a_shape``, ``b_shape`` from PEFT's tensors (the inverse of ``_to_peft``)."""
    for name, hf, shape in (("lora_A", lora_a, a_shape), ("lora_B", lora_b, b_shape)):
        if hf.size != math.prod(shape):
            raise ValueError(f"{name} has shape {hf.shape}, the model needs {tuple(shape)} elements")
    if expert:
        X, R = a_shape[0], a_shape[-1]
        a = lora_a.reshape(X, R, -1).transpose(0, 2, 1)
        b = lora_b.reshape(-1, R, X).transpose(2, 1, 0)
        return a.reshape(a_shape), b.reshape(b_shape)
    return lora_a.T.reshape(a_shape), lora_b.T.reshape(b_shape)


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
    return config


def spec_from_config(config: dict, model_cfg=None) -> lora.LoraSpec:
    """The spec of a PEFT adapter config on ``model_cfg``'s family (None: a dense decoder): ``target_modules``
    as ``resolve_targets`` reads them, plus the expert / router ``target_parameters``."""
    targets, parameters = config.get("target_modules"), config.get("target_parameters") or []
    if isinstance(targets, str) and targets != lora.ALL_LINEAR:
        raise ValueError(f"adapter target_modules {targets!r}: regular expressions are not supported")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    chosen = set(resolve_targets(targets, f"{CONFIG_FILE} target_modules", model_cfg) if targets or not parameters
                 else ())
    for entry in parameters:
        found = [t for t, name in PEFT_PARAMETERS.items() if entry == name or entry.endswith("." + name)]
        if not found:
            raise ValueError(f"{CONFIG_FILE} target_parameters entry {entry!r} is not supported (only "
                             f"{', '.join(PEFT_PARAMETERS.values())})")
        chosen.add(found[0])
    fused = EXPERT_GATE_UP in chosen
    for key, expected in (("rank_pattern", {GATE_UP_PATTERN: 2 * rank} if fused else {}),
                          ("alpha_pattern", {GATE_UP_PATTERN: 2 * alpha} if fused else {})):
        got = {k: float(v) for k, v in (config.get(key) or {}).items()}
        if got != {k: float(v) for k, v in expected.items()}:
            raise ValueError(f"{CONFIG_FILE}: {key}={config.get(key)} is not supported (expected {expected}: "
                             "PEFT's doubled rank and alpha on the fused gate_up_proj, nothing else)")
    return lora.LoraSpec(rank, alpha, tuple(t for t in ALL_TARGETS if t in chosen))


def peft_config(spec: lora.LoraSpec, base_model: str | None) -> dict:
    """The ``adapter_config.json`` PEFT writes for these adapters."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "target_modules": [t for t in spec.targets if t not in PEFT_PARAMETERS], "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
              "base_model_name_or_path": base_model}
    parameters = [PEFT_PARAMETERS[t] for t in spec.targets if t in PEFT_PARAMETERS]
    if parameters:
        config["target_parameters"] = parameters
    if EXPERT_GATE_UP in spec.targets:
        config["rank_pattern"] = {GATE_UP_PATTERN: 2 * spec.rank}
        config["alpha_pattern"] = {GATE_UP_PATTERN: 2 * spec.alpha}
    return config


def save_adapter(model: nnx.Module, out_dir: str, base_model: str | None = None) -> str:
    """Write ``model``'s adapters as a PEFT adapter directory (process 0 writes)."""
    from rlhf_jax.models.hf_export import to_host

    spec = model.config.lora
    tensors = {}
    for weight_path, a, b in _adapted(nnx.state(model, nnx.Param)):
        module = _peft_module(weight_path, spec, model.config)
        lora_a, lora_b = _to_peft(to_host(a.get_value()), to_host(b.get_value()), lora.is_expert_weight(weight_path))
        tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(lora_a)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(lora_b)
    if not groups.current().is_first:
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(peft_config(spec, base_model), f, indent=2)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def load_adapter(model: nnx.Module, path: str) -> nnx.Module:
    """``model`` (with adapters of the same rank, alpha and targets) with the adapter weights of a PEFT directory."""
    path = os.path.expanduser(path)
    found = spec_from_config(read_config(path), model.config)
    spec = model.config.lora
    if (found.rank, found.alpha, found.targets) != (spec.rank, spec.alpha, spec.targets):
        raise ValueError(f"{path}: adapter has r={found.rank}, lora_alpha={found.alpha:g}, targets="
                         f"{list(found.targets)}; the run asks for lora_rank={spec.rank}, lora_alpha={spec.alpha:g}, "
                         f"targets={list(spec.targets)}")
    file = LazyFile(os.path.join(path, WEIGHTS_FILE))
    names = set(file.keys())
    graphdef, state = nnx.split(model)
    used = set()
    for weight_path, a, b in _adapted(state):
        module = f"{PREFIX}{_peft_module(weight_path, spec, model.config)}"
        pair = (f"{module}.lora_A.weight", f"{module}.lora_B.weight")
        for name in pair:
            if name not in names:
                raise ValueError(f"{path}: {WEIGHTS_FILE} lacks {name}")
        try:
            hosts = _from_peft(np.asarray(file.get(pair[0])), np.asarray(file.get(pair[1])), a.get_value().shape,
                               b.get_value().shape, lora.is_expert_weight(weight_path))
        except ValueError as e:
            raise ValueError(f"{path}: {module}: {e}") from None
        for var, host in zip((a, b), hosts):
            value = var.get_value()
            host = host.astype(value.dtype)
            var.set_value(jax.make_array_from_callback(value.shape, value.sharding, lambda idx, h=host: h[idx]))
        used.update(pair)
    extra = sorted(names - used)
    if extra:
        raise ValueError(f"{path}: {WEIGHTS_FILE} holds tensors the model has no place for: {extra[:4]}")
    return nnx.merge(graphdef, state)
