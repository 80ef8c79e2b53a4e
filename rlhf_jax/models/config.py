"""Model configuration built from a Hugging Face ``config.json``.

One decoder implementation serves the Llama family (Llama 2/3, SmolLM2, Mistral
with its sliding window), Qwen2/Qwen2.5 (q/k/v bias), Qwen3 (q/k RMSNorm), Phi-3
(Llama with fused q/k/v and gate/up projections in the checkpoint, see ``hf_names``), Gemma 2 and
Gemma 3 text (the fields from ``hidden_act`` to ``final_logit_softcap`` below; Gemma 3 adds q/k norms
and a RoPE of its own on the sliding layers), and the Mixture-of-Experts Qwen3-MoE and Qwen2-MoE (the
fields from ``num_experts`` on; their sparse MLP blocks are ``models/moe.py``).
``ModelConfig`` holds exactly what that decoder needs; the original HF dict is
kept so that export writes back a config that ``transformers`` understands.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

from rlhf_jax.config.names import CONTEXT_ATTENTION
from rlhf_jax.models import remat
from rlhf_jax.models.attention import DECODE_IMPLEMENTATIONS, IMPLEMENTATIONS
from rlhf_jax.models.rope import ROPE_TYPES, RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")

# MLP gate activations by their transformers names.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")

# Gradient checkpointing per decoder layer: "none", or a policy of models/remat.py.
REMAT_POLICIES = ("none", *remat.POLICIES)

# Which head a checkpoint carries, read from ``architectures``.
TASK_CAUSAL_LM = "causal_lm"
TASK_SEQ_CLS = "seq_cls"  # *ForSequenceClassification: one score per sequence (reward model)
TASK_TOKEN_VALUE = "token_value"  # *ForTokenClassification with one label: one value per token (critic)
# A causal LM with a value head on its trunk (an actor-critic sharing its weights); exported as the causal LM
# plus the head's weights, so no checkpoint names this task.
TASK_CAUSAL_LM_VALUE = "causal_lm_value"
TASKS = (TASK_CAUSAL_LM, TASK_SEQ_CLS, TASK_TOKEN_VALUE, TASK_CAUSAL_LM_VALUE)
_ARCH_SUFFIX_TO_TASK = {
    "ForCausalLM": TASK_CAUSAL_LM,
    "ForSequenceClassification": TASK_SEQ_CLS,
    "ForTokenClassification": TASK_TOKEN_VALUE,
}
_ARCH_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3", "gemma2": "Gemma2", "gemma3_text": "Gemma3",
                "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one this package implements."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama with attention_bias)
    o_bias: bool  # the output projection carries a bias (Llama with attention_bias)
    mlp_bias: bool  # gate/up/down projections carry a bias (Llama with mlp_bias)
    qk_norm: bool  # RMSNorm on q and k per head before RoPE (Qwen3, Gemma 3)
    sliding_window: int | None = None  # a query sees the keys less than this many tokens before it
    # Per layer "full_attention" or "sliding_attention" (transformers' layer_types); empty: every layer
    # slides when sliding_window is set.
    layer_types: tuple[str, ...] = ()
    local_rope: RopeConfig | None = None  # the sliding layers' own RoPE (Gemma 3); None: ``rope`` everywhere
    hidden_act: str = "silu"  # the MLP's gate activation, one of ACTIVATIONS
    embedding_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight) (Gemma)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (Gemma: post_attention_layernorm
    # is then the attention output's norm, and pre/post_feedforward_layernorm surround the MLP)
    attn_scale: float | None = None  # query scaling (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float | None = None  # attention scores capped to cap * tanh(s / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the output logits (Gemma 2)
    # Mixture-of-Experts (0 experts: every layer is a dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # the top-k routing weights are renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # > 0: a shared expert behind a sigmoid gate (Qwen2-MoE)
    sparse_layers: tuple[bool, ...] = ()  # per layer: a sparse MoE block (True) or the dense MLP
    num_labels: int = 1
    pad_token_id: int | None = None
    # Runtime settings, not part of the checkpoint.
    dtype: Any = jnp.float32  # computation dtype
    param_dtype: Any = jnp.float32
    remat: str = "none"  # one of REMAT_POLICIES; True / False are read as "full" / "none"
    attn_impl: str = "auto"  # one of attention.IMPLEMENTATIONS
    decode_attn_impl: str = "auto"  # the sampler's one-token step, one of attention.DECODE_IMPLEMENTATIONS
    context_attention: str = "auto"  # attention under a sequence split (mesh.context_attention), CONTEXT_ATTENTION
    pallas_interpret: bool = False  # run the Pallas decode kernels in interpret mode (any backend; tests)
    lora: Any = None  # a models.lora.LoraSpec: adapters on the projections it targets (None: a plain model)
    hf_config: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "remat", remat_policy(self.remat))
        if self.attn_impl not in IMPLEMENTATIONS:
            raise ValueError(f"attn_impl {self.attn_impl!r} is not one of {IMPLEMENTATIONS}")
        if self.decode_attn_impl not in DECODE_IMPLEMENTATIONS:
            raise ValueError(f"decode_attn_impl {self.decode_attn_impl!r} is not one of {DECODE_IMPLEMENTATIONS}")
        if self.context_attention not in CONTEXT_ATTENTION:
            raise ValueError(f"context_attention {self.context_attention!r} is not one of {CONTEXT_ATTENTION}")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: full causal attention)."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a Mixture-of-Experts block instead of the dense MLP."""
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def remat_policy(setting: bool | str) -> str:
    """The remat policy name for ``setting``: a policy name, or the old boolean switch."""
    if isinstance(setting, bool):
        return "full" if setting else "none"
    if setting not in REMAT_POLICIES:
        raise ValueError(f"remat {setting!r} is not one of {REMAT_POLICIES} (or a bool)")
    return setting


# Families whose attention rotates only the leading partial_rotary_factor of each head.
_PARTIAL_ROTARY_TYPES = ("phi3",)


def _rope_from_hf(hf: dict, params: dict | None = None) -> RopeConfig:
    """The RoPE settings as transformers reads them (``RotaryEmbeddingConfigMixin.standardize_rope_params``);
    ``params`` is one layer type's dict where they are nested by layer type (Gemma 3)."""
    # transformers < 5 writes rope_theta + rope_scaling; >= 5 writes rope_parameters.
    if params is None:
        params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if hf.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3Config renames its older names
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported; supported rope types: {', '.join(ROPE_TYPES)}")
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0))
    if partial != 1.0 and hf.get("model_type") not in _PARTIAL_ROTARY_TYPES:
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is supported for {', '.join(_PARTIAL_ROTARY_TYPES)} only")
    max_pos = int(hf.get("max_position_embeddings", 2048))
    # A top-level original_max_position_embeddings (Phi-3 writes one) takes precedence, as in transformers.
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor")
    if factor is None:  # yarn and longrope derive it from the two context lengths
        factor = max_pos / original if rope_type in ("yarn", "longrope") else 1.0

    def optional_float(key):
        return None if params.get(key) is None else float(params[key])

    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        max_position_embeddings=max_pos,
        attention_factor=optional_float("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=optional_float("mscale"),
        mscale_all_dim=optional_float("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        partial_rotary_factor=partial,
    )


_GEMMA = ("gemma2", "gemma3_text")


def _gemma_from_hf(hf: dict, model_type: str, hidden: int) -> dict:
    """The activation, and for Gemma its scalings, (1 + w) norms, sandwich norms and soft caps."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"activation {act!r} is not supported; supported activations: {', '.join(ACTIVATIONS)}")
    if model_type not in _GEMMA:
        return dict(hidden_act=act)
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention is not supported (the decoder is causal)")
    return dict(
        hidden_act=act,
        embedding_scale=hidden**0.5,
        norm_unit_offset=True,
        sandwich_norms=True,
        attn_scale=float(hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 256) ** -0.5,
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )


def _gemma3_ropes(hf: dict) -> dict:
    """Gemma 3's two RoPEs: the global layers' (with any scaling) and the local (sliding) layers' own base."""
    nested = hf.get("rope_parameters") or {}
    if "full_attention" in nested:
        full, local = nested["full_attention"], nested.get("sliding_attention") or {}
    else:  # older config.json: rope_theta and rope_scaling for the global layers, rope_local_base_freq for the local
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    local = {"rope_type": "default", "rope_theta": 10_000.0, **local}
    return dict(rope=_rope_from_hf(hf, {"rope_theta": 1_000_000.0, **full}), local_rope=_rope_from_hf(hf, local))


def _sliding_window_from_hf(hf: dict, model_type: str) -> dict:
    """``sliding_window`` and ``layer_types`` as the transformers models apply them."""
    window = hf.get("sliding_window")
    if model_type == "qwen3_moe":  # every layer, when switched on
        return dict(sliding_window=int(window)) if window and hf.get("use_sliding_window") else {}
    if model_type in ("mistral", "phi3"):  # every layer, whenever a window is set
        return dict(sliding_window=int(window)) if window else {}
    if model_type in _GEMMA:  # local (sliding) and global layers: Gemma 2 alternates, Gemma 3 has 5 local per global
        pattern = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern", 6))
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(int(hf["num_hidden_layers"]))]
        return dict(sliding_window=int(window), layer_types=tuple(types)) if window else {}
    if not (window and hf.get("use_sliding_window")):  # Qwen2/Qwen3 switch it on explicitly
        return {}
    layers, max_window = int(hf["num_hidden_layers"]), int(hf.get("max_window_layers", 28))
    if model_type == "qwen2_moe":  # even-numbered layers below max_window_layers (Qwen2MoeConfig's default)
        default = ["sliding_attention" if (i + 1) % 2 and i < max_window else "full_attention" for i in range(layers)]
    else:
        default = ["sliding_attention" if i >= max_window else "full_attention" for i in range(layers)]
    types = hf.get("layer_types") or default
    return dict(sliding_window=int(window), layer_types=tuple(types))


def _moe_from_hf(hf: dict, model_type: str) -> dict:
    """The experts, the router's top-k and which layers are sparse, as the transformers decoder layers decide:
    a layer is sparse unless listed in ``mlp_only_layers``, when (layer + 1) is a multiple of ``decoder_sparse_step``."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    step = int(hf.get("decoder_sparse_step") or 1)
    only_mlp = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i not in only_mlp and experts > 0 and (i + 1) % step == 0 for i in range(int(hf["num_hidden_layers"])))
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0,
        sparse_layers=sparse,
    )


def task_from_hf(hf: dict) -> str:
    """The head a checkpoint carries (causal LM, sequence score or token value)."""
    for arch in hf.get("architectures") or []:
        for suffix, task in _ARCH_SUFFIX_TO_TASK.items():
            if arch.endswith(suffix):
                return task
    return TASK_CAUSAL_LM


def architecture_name(model_type: str, task: str) -> str:
    task = TASK_CAUSAL_LM if task == TASK_CAUSAL_LM_VALUE else task  # the value head is saved beside the LM
    suffix = {v: k for k, v in _ARCH_SUFFIX_TO_TASK.items()}[task]
    if model_type == "gemma3_text" and task != TASK_CAUSAL_LM:  # Gemma3For* heads are the multimodal model's
        return "Gemma3Text" + suffix
    return _ARCH_PREFIX[model_type] + suffix


def from_hf_dict(hf: dict, **runtime) -> ModelConfig:
    """Build a ``ModelConfig`` from a parsed HF config.json; ``runtime`` sets the runtime fields (dtype, param_dtype,
    remat, attn_impl, context_attention, ...)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    max_pos = int(hf.get("max_position_embeddings", 2048))
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // heads
    num_labels = hf.get("num_labels")
    if num_labels is None:
        # transformers omits id2label when it is its default of 2 labels; a head built here for another
        # checkpoint (a reward model from a causal LM) has one.
        num_labels = len(hf.get("id2label") or {}) or (2 if task_from_hf(hf) == TASK_SEQ_CLS else 1)
    pad = hf.get("pad_token_id")
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        **(_gemma3_ropes(hf) if model_type == "gemma3_text" else dict(rope=_rope_from_hf(hf))),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type in _GEMMA)),
        qkv_bias=(model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
                  or (model_type in ("llama", "qwen3", "qwen3_moe") and bool(hf.get("attention_bias")))),
        o_bias=model_type in ("llama", "qwen3", "qwen3_moe") and bool(hf.get("attention_bias")),
        mlp_bias=model_type == "llama" and bool(hf.get("mlp_bias")),
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
        **_sliding_window_from_hf(hf, model_type),
        **_gemma_from_hf(hf, model_type, hidden),
        **_moe_from_hf(hf, model_type),
        num_labels=int(num_labels),
        pad_token_id=pad,
        hf_config=dict(hf),
        **runtime,
    )


def load_hf_config(path: str) -> dict:
    """Read ``config.json`` from a local HF directory, with a clear error when it is missing."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json: not a Hugging Face model directory")
    with open(cfg_path) as f:
        return json.load(f)
