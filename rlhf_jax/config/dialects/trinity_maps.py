"""Trinity-RFT keys whose values map onto several of ours: the LoRA adapter list and the advantage function's
arguments."""

from __future__ import annotations

from typing import Any

_A = "actor_rollout_ref."
_LORA_KEYS = {"lora_rank": "model.lora_rank", "lora_alpha": "model.lora_alpha",
              "target_modules": "model.target_modules", "path": "model.lora_adapter_path"}
_LORA_IGNORED = ("name", "base_model_name")  # labels of Trinity's adapter registry
# Trinity's advantage functions' arguments that are ours too (their other defaults are fixed here: verl's)
_ADVANTAGE_ARGS = {"gamma": "algorithm.gamma", "lam": "algorithm.lam"}
_FIXED_ARGS = {"epsilon": 1e-6}  # GRPO's and RLOO's normalisation epsilon, fixed at verl's value


def lora(value: Any, _: dict) -> dict:
    """The one adapter of ``model.lora_configs`` onto actor_rollout_ref.model.lora_* (rank, alpha, target modules,
    a saved adapter's path); refused: several adapters, or a setting of Trinity's adapters with no equivalent."""
    if not value:
        return {}
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict):
        raise ValueError("rlhf_jax trains one LoRA adapter per run: give model.lora_configs one entry")
    entry = value[0]
    unknown = sorted(set(entry) - set(_LORA_KEYS) - set(_LORA_IGNORED))
    if unknown:
        raise ValueError(f"model.lora_configs[0].{unknown[0]} has no rlhf_jax equivalent (rank, alpha, "
                         "target_modules and path map onto actor_rollout_ref.model.lora_*)")
    out: dict[str, Any] = {}
    for theirs, ours in _LORA_KEYS.items():
        if entry.get(theirs) is None:
            continue
        v = entry[theirs]
        if theirs == "target_modules":
            v = (v,) if isinstance(v, str) else tuple(v)
        out[_A + ours] = {"lora_rank": int, "lora_alpha": float}.get(theirs, lambda x: x)(v)
    if _A + "model.lora_rank" not in out:
        raise ValueError("model.lora_configs[0] needs lora_rank")
    return out


def advantage_args(value: Any, _: dict) -> dict:
    """``algorithm.advantage_fn_args``: gamma and lam onto algorithm.gamma / lam; epsilon only at its fixed value;
    any other argument is refused by name."""
    out: dict[str, Any] = {}
    for name, arg in (value or {}).items():
        if name in _ADVANTAGE_ARGS:
            out[_ADVANTAGE_ARGS[name]] = float(arg)
        elif name in _FIXED_ARGS and float(arg) == _FIXED_ARGS[name]:
            continue
        elif name in _FIXED_ARGS:
            raise ValueError(f"algorithm.advantage_fn_args.{name}={arg}: the group normalisation's epsilon is "
                             f"fixed at {_FIXED_ARGS[name]} here")
        else:
            raise ValueError(f"algorithm.advantage_fn_args.{name} has no rlhf_jax equivalent (gamma and lam map "
                             "onto algorithm.gamma / lam)")
    return out


def _merged(base: dict, stage: dict) -> dict:
    """``stage`` over ``base``, key by key (a stage inherits what it does not set). A stage's experience buffer
    replaces the global one: the global one is the RL queue between explorer and trainer, which a stage that
    trains from a dataset does not read."""
    out = dict(base)
    for key, value in stage.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "experience_buffer":
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def stages(full: dict, values: dict[str, Any], translate: Any, default_of: Any) -> tuple[dict, ...]:
    """Trinity's ``stages`` as rlhf_jax stages: each stage is the whole file with the stage's sections merged in,
    translated like a file (``translate(mapping, where) -> {schema key: value}``, errors named by ``where``), and kept as the keys where it differs
    from the file's own translation (``values``); a key only the file sets returns to its default
    (``default_of(key)``)."""
    base = {k: v for k, v in full.items() if k != "stages"}
    out = []
    for i, stage in enumerate(full.get("stages") or ()):
        if not isinstance(stage, dict):
            raise ValueError(f"stages[{i}] must be a mapping with a stage_name, got {type(stage).__name__}")
        stage = dict(stage)
        name = str(stage.pop("stage_name", f"stage{i}"))
        merged = _merged(base, stage)
        if merged.get("mode") == "train":  # no explorer runs: the global taskset and workflows are not read
            merged["buffer"] = {k: v for k, v in merged.get("buffer", {}).items() if k != "explorer_input"}
        mine = translate(merged, f"stages[{i}] ({name})")
        overrides = {k: v for k, v in mine.items() if k != "stages" and values.get(k, _UNSET) != v}
        overrides.update({k: default_of(k) for k in values if k not in mine and k != "stages"})
        out.append({"stage_name": name, **overrides})
    return tuple(out)


_UNSET = object()
