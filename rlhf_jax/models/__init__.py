"""Flax NNX decoder models (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3, Qwen2-MoE, Qwen3-MoE) with Hugging Face
import and export."""

from rlhf_jax.models.config import (
    SUPPORTED_MODEL_TYPES,
    TASK_CAUSAL_LM,
    TASK_CAUSAL_LM_VALUE,
    TASK_SEQ_CLS,
    TASK_TOKEN_VALUE,
    ModelConfig,
    UnsupportedModelError,
    from_hf_dict,
    load_hf_config,
)
from rlhf_jax.models.attention import attention
from rlhf_jax.models.decoder import (
    CausalLM,
    CausalLMWithValue,
    SequenceClassifier,
    TokenValueModel,
    positions_from_mask,
    positions_from_segments,
)
from rlhf_jax.models.hf_export import save_pretrained
from rlhf_jax.models.hf_import import CheckpointError, from_pretrained, init_model
from rlhf_jax.models.sharding import shard_model, state_shardings

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TASK_CAUSAL_LM",
    "TASK_CAUSAL_LM_VALUE",
    "TASK_SEQ_CLS",
    "TASK_TOKEN_VALUE",
    "CausalLM",
    "CausalLMWithValue",
    "CheckpointError",
    "ModelConfig",
    "SequenceClassifier",
    "TokenValueModel",
    "UnsupportedModelError",
    "attention",
    "from_hf_dict",
    "from_pretrained",
    "init_model",
    "load_hf_config",
    "positions_from_mask",
    "positions_from_segments",
    "save_pretrained",
    "shard_model",
    "state_shardings",
]
