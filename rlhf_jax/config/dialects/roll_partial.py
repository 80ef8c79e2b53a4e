"""ROLL's partial training of the actor: LoRA adapters (``model_args.lora_*``) and frozen modules
(``model_args.freeze_module_prefix``).

In ROLL a worker trains LoRA adapters when ``lora_target`` names their modules (``all-linear`` or a comma list);
``lora_rank`` then defaults to 8 and ``lora_alpha`` to twice the rank, scaled as PEFT scales (alpha / rank).
The sampler reads the actor's own adapters here, so ``actor_infer``'s copy of the settings describes nothing new.

``freeze_module_prefix`` freezes every parameter whose Hugging Face name starts with one of its comma-separated
prefixes. Here freezing is by parameter group (``actor.freeze.freeze_*``), so a prefix maps only where it names
whole groups: ``model.embed_tokens`` the embedding, ``lm_head`` an untied output layer, ``model`` everything but the
output layer; any other prefix (one layer, the final norm alone) is refused by name.
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.config.dialects.rules import Rule, get

_M = "actor_rollout_ref.model."
_F = "actor_rollout_ref.actor.freeze."
_FROZEN = {"model.embed_tokens": ("emb",), "lm_head": ("other",), "model": ("emb", "ln", "attn", "ff")}
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _targets(text: str) -> tuple[str, ...]:
    if any(c in text for c in "*$|("):
        raise ValueError("a regular expression of module names is not supported: name them (q_proj,v_proj,...) "
                         "or write all-linear")
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if names == ("all-linear",) or set(names) == set(_PROJECTIONS):
        return ("all-linear",)
    unknown = [n for n in names if n not in _PROJECTIONS]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: adapters go on {', '.join(_PROJECTIONS)} or all-linear")
    return names


def _lora(prefix: str):
    def convert(value: Any, full: dict) -> dict:
        if value is None:
            return {}  # no target: ROLL trains every weight
        rank = int(get(full, prefix + "lora_rank") or 8)
        alpha = get(full, prefix + "lora_alpha")
        return {_M + "lora_rank": rank, _M + "lora_alpha": float(alpha if alpha is not None else 2 * rank),
                _M + "target_modules": _targets(str(value))}
    return convert


def _freeze(value: Any, _: dict) -> dict:
    if value is None:
        return {}
    groups: set[str] = set()
    for prefix in (p.strip().rstrip(".") for p in str(value).split(",") if p.strip()):
        if prefix not in _FROZEN:
            raise ValueError(f"prefix {prefix!r} does not name whole parameter groups; freezable here: "
                             f"{', '.join(_FROZEN)} (or actor_rollout_ref.actor.freeze.* by group)")
        groups.update(_FROZEN[prefix])
    return {_F + f"freeze_{g}": True for g in sorted(groups)}


def lora_rules(role: str) -> tuple[Rule, ...]:
    p = f"{role}.model_args."
    if role != "actor_train":
        return (Rule(p + "lora_*", reason="the sampler and the reference read the actor's own weights and adapters"),)
    return (
        Rule(p + "lora_target", convert=_lora(p)),
        Rule(p + "lora_rank", used_by=p + "lora_target"),
        Rule(p + "lora_alpha", used_by=p + "lora_target"),
        Rule(p + "lora_dropout", reason="LoRA without dropout", accept=lambda v: not v),
        Rule(p + "freeze_module_prefix", convert=_freeze),
    )
