"""What a LoRA ``target_modules`` adapts in each model family, with PEFT's meaning (PEFT 0.21.2, transformers 5.24).

Dense decoders: each name is an ``nn.Linear`` leaf (q/k/v/o_proj, gate/up/down_proj); ``all-linear`` is all of
them, never the output head. Each adapter is ``scale * B A`` with ``scale = lora_alpha / r``.

Mixture-of-Experts. transformers 5 stores a sparse block's routed experts as two fused parameters,
``mlp.experts.gate_up_proj`` (X, 2F, E), gate rows first, and ``mlp.experts.down_proj`` (X, E, F); its router
``mlp.gate`` is a module holding ``weight`` (X, E), not an ``nn.Linear``. Before injecting, PEFT rewrites the
config of the model types that transformers' conversion table maps to its ``qwen2_moe`` pattern
(``peft/utils/transformers_weight_conversion.py``, ``_convert_peft_config_moe``):

- Qwen3-MoE (mapped): ``gate_proj`` + ``up_proj`` (both or neither; one alone is an error) become the
  ``target_parameters`` entry ``gate_up_proj``, with ``rank_pattern`` / ``alpha_pattern``
  ``{".*\\.gate_up_proj": 2r / 2 lora_alpha}``: one rank-2r adapter over the fused projection, same scale;
  ``down_proj`` becomes ``down_proj`` (rank r) and ``gate`` becomes ``gate.weight`` (the router, rank r).
  ``all-linear`` is q/k/v/o_proj plus those three. The dense MLPs of ``mlp_only_layers`` are then not adapted
  (their names now mean the experts).
- Qwen2-MoE: the table maps ``qwen2_moe`` to no pattern, so nothing is rewritten and the names match
  ``nn.Linear`` modules only: gate/up/down_proj adapt the dense MLPs and the shared expert, ``shared_expert_gate``
  (a Linear E -> 1) its gate; ``all-linear`` is those plus q/k/v/o_proj. The routed experts and the router are not
  adapted.

An expert parameter is adapted by a ``ParamWrapper``. On a 3-d parameter read as (X, out, in) it holds
``lora_A.weight`` (R X, in), row ``x R + k`` (expert-major), and ``lora_B.weight`` (out, R X), column ``k X + x``
(rank-major); expert x's delta is ``scale * B_x A_x`` with ``A_x = lora_A[x R:(x + 1) R]``,
``B_x = lora_B[:, x::X]``. A module's wrappers nest in parameter order, so with both adapted the saved names are
``mlp.experts.base_layer.lora_{A,B}.weight`` (gate_up_proj, inside) and ``mlp.experts.lora_{A,B}.weight``
(down_proj); alone, either is ``mlp.experts.lora_{A,B}.weight``. The router's are ``mlp.gate.lora_A.weight`` (r, E)
and ``lora_B.weight`` (X, r), as a Linear's.

Our target names (``LoraSpec.targets``, in ``ALL_TARGETS`` order): the projections, ``shared_expert_gate``,
``gate`` (router), ``experts.gate_up_proj`` (rank 2r) and ``experts.down_proj``.
"""

from __future__ import annotations

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION + MLP
ROUTER, SHARED_GATE = "gate", "shared_expert_gate"
EXPERT_GATE_UP, EXPERT_DOWN = "experts.gate_up_proj", "experts.down_proj"
ALL_TARGETS = PROJECTIONS + (SHARED_GATE, ROUTER, EXPERT_GATE_UP, EXPERT_DOWN)
ALL_LINEAR = "all-linear"
# Model types whose expert names PEFT moves onto the fused expert parameters (see the module docstring).
FUSED_EXPERT_TYPES = ("qwen3_moe",)
# Our expert targets <-> PEFT's ``target_parameters`` entries.
PEFT_PARAMETERS = {ROUTER: "gate.weight", EXPERT_GATE_UP: "gate_up_proj", EXPERT_DOWN: "down_proj"}


def fused_experts(model_cfg) -> bool:
    return bool(model_cfg is not None and model_cfg.num_experts and model_cfg.model_type in FUSED_EXPERT_TYPES)


def module_names(model_cfg=None) -> tuple[str, ...]:
    """The ``target_modules`` names ``model_cfg``'s family accepts (None: a dense decoder)."""
    if fused_experts(model_cfg):
        return PROJECTIONS + (ROUTER,)
    if model_cfg is not None and model_cfg.shared_expert_intermediate_size:
        return PROJECTIONS + (SHARED_GATE,)
    return PROJECTIONS


def resolve_targets(target_modules, key: str = "target_modules", model_cfg=None) -> tuple[str, ...]:
    """Our targets for ``target_modules`` (``all-linear`` or a list of module names) on ``model_cfg``'s family
    (None: a dense decoder); a name the family lacks, or half of a fused pair, is an error naming ``key``."""
    names = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules or ())
    known = module_names(model_cfg)
    if not names:
        raise ValueError(f"{key} is empty: give all-linear or module names ({', '.join(known)})")
    if ALL_LINEAR in names:
        if len(names) > 1:
            raise ValueError(f"{key}={list(names)}: all-linear stands alone")
        names = known
    unknown = [n for n in names if n not in known]
    if unknown:
        kind = f" of {model_cfg.model_type}" if model_cfg is not None and model_cfg.num_experts else ""
        raise ValueError(f"{key}: no module named {', '.join(map(repr, unknown))} in the decoder{kind}; "
                         f"choose all-linear or from {', '.join(known)}")
    chosen = set(names)
    if fused_experts(model_cfg):
        if len(chosen & {"gate_proj", "up_proj"}) == 1:
            raise ValueError(f"{key}: gate_proj and up_proj are one fused parameter (mlp.experts.gate_up_proj) "
                             f"in {model_cfg.model_type}: name both or neither")
        chosen = (chosen & set(ATTENTION + (ROUTER,))) | ({EXPERT_GATE_UP} if "gate_proj" in chosen else set()) | (
            {EXPERT_DOWN} if "down_proj" in chosen else set())
    return tuple(t for t in ALL_TARGETS if t in chosen)


def rank_of(target: str, rank: int) -> int:
    """The adapter rank of ``target``: PEFT's rank pattern doubles it on the fused gate_up_proj."""
    return 2 * rank if target == EXPERT_GATE_UP else rank
