"""Which parameters an update trains: frozen groups (embeddings, norms, attention, MLP, other) and LoRA.

A parameter belongs to one group by its path in the model state:

- ``emb``: the token embedding table (``model.embed_tokens``; also the output projection when tied);
- ``ln``: every RMSNorm weight (``*_layernorm``, ``q_norm`` / ``k_norm``, the final ``norm``);
- ``attn``: the rest of ``self_attn`` (q/k/v/o projections and their biases);
- ``ff``: ``mlp`` (dense MLP, or a MoE block's router and experts);
- ``other``: everything else (an untied ``lm_head``, a reward or value head).

``layers_not_to_freeze`` lists decoder layers whose parameters train whatever the flags say.
The result is a filter ``(path, value) -> bool`` (True = trained) for ``nnx.split``; the frozen
parameters then get no gradient and no optimizer state (``engine.Role``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx

GROUPS = ("emb", "ln", "attn", "ff", "other")
KEY = "actor_rollout_ref.actor.freeze."
Filter = Callable[[tuple, Any], bool]


@dataclasses.dataclass(frozen=True)
class FreezeSpec:
    groups: frozenset[str] = frozenset()  # subset of GROUPS
    layers_not_to_freeze: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, freeze_cfg) -> "FreezeSpec":
        groups = frozenset(g for g in GROUPS if freeze_cfg[f"freeze_{g}"])
        return cls(groups, tuple(int(i) for i in (freeze_cfg.layers_not_to_freeze or ())))

    @property
    def active(self) -> bool:
        return bool(self.groups or self.layers_not_to_freeze)


def group_of(path: tuple) -> str:
    names = [str(p) for p in path]
    if "embed_tokens" in names:
        return "emb"
    if any(n.endswith("norm") for n in names):
        return "ln"
    if "self_attn" in names:
        return "attn"
    if "mlp" in names:
        return "ff"
    return "other"


def layer_of(path: tuple) -> int | None:
    """The decoder layer index of a parameter path (None outside the layers)."""
    names = list(path)
    for i, p in enumerate(names[:-1]):
        if str(p) == "layers":
            return int(names[i + 1])
    return None


def trainable_filter(spec: FreezeSpec) -> Filter:
    def trained(path, _value=None) -> bool:
        layer = layer_of(path)
        if layer is not None and layer in spec.layers_not_to_freeze:
            return True
        return group_of(path) not in spec.groups

    return trained


def check(spec: FreezeSpec, state: nnx.State, num_layers: int) -> Filter:
    """The trainable filter of ``spec`` over a model ``state`` (abstract is enough); every flag and listed layer
    must name parameters, and something must stay trainable (ValueError naming the key otherwise)."""
    paths = [p for p, _ in nnx.to_flat_state(state)]
    present = {group_of(p) for p in paths}
    for g in sorted(spec.groups):
        if g not in present:
            raise ValueError(f"{KEY}freeze_{g}=True names no parameter: the model has no {g!r} parameters "
                             "(unset it)")
    bad = [i for i in spec.layers_not_to_freeze if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{KEY}layers_not_to_freeze={list(spec.layers_not_to_freeze)}: layers {bad} do not exist "
                         f"(the model has layers 0..{num_layers - 1})")
    if spec.layers_not_to_freeze and not spec.groups:
        raise ValueError(f"{KEY}layers_not_to_freeze={list(spec.layers_not_to_freeze)} names no frozen parameter: "
                         f"no {KEY}freeze_* flag is set")
    trained = trainable_filter(spec)
    kept = [p for p in spec.layers_not_to_freeze
            if not any(layer_of(q) == p and group_of(q) in spec.groups for q in paths)]
    if kept:
        raise ValueError(f"{KEY}layers_not_to_freeze: layers {kept} hold no parameter of the frozen groups "
                         f"{sorted(spec.groups)}")
    if not any(trained(p) for p in paths):
        raise ValueError(f"{KEY}*: every parameter is frozen; nothing would train (unset a freeze_* flag)")
    return trained

