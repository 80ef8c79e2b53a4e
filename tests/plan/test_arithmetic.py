"""The plan's model arithmetic against the parameters the model really has (abstract: nothing allocated)."""

import jax
import pytest
from flax import nnx

from rlhf_jax import models
from rlhf_jax.models.hf_import import build_abstract
from rlhf_jax.plan.abstract import hf_config
from rlhf_jax.plan.arithmetic import ModelShape, decode_work, forward_flops, sequence_flops


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct"])
def test_matmul_parameters_equal_the_models_weight_matrices(name):
    cfg = models.from_hf_dict(hf_config(name))
    _, state = nnx.split(build_abstract(cfg, models.TASK_CAUSAL_LM))
    matrices = sum(v.get_value().size for path, v in nnx.to_flat_state(state)
                   if v.get_value().ndim >= 2 and "embed_tokens" not in path and not str(path[-1]).endswith("bias"))
    head = cfg.hidden_size * cfg.vocab_size if cfg.tie_word_embeddings else 0  # the tied head is the embedding
    assert ModelShape.of(cfg).active_matmul_params() == matrices + head
    total = sum(x.size for x in jax.tree.leaves(state))
    assert abs(total - {"Qwen/Qwen2.5-0.5B-Instruct": 494_032_768, "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512}[name]) \
        < 1e-6 * total  # the parameter counts published with the models


def test_moe_counts_the_top_k_experts_and_the_router():
    cfg = models.from_hf_dict(hf_config("Qwen/Qwen3-30B-A3B"))
    shape = ModelShape.of(cfg)
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    attention = 2 * d * cfg.num_attention_heads * cfg.head_dim + 2 * d * cfg.num_key_value_heads * cfg.head_dim
    per_layer = attention + d * cfg.num_experts + 8 * 3 * d * cfg.moe_intermediate_size
    assert shape.active_matmul_params() == layers * per_layer + d * cfg.vocab_size
    assert 3.0e9 < shape.active_matmul_params() < 3.6e9  # "A3B": about 3.3 B active parameters


def test_flops_and_decode_work_by_hand():
    shape = ModelShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, vocab=16, mlp_width=12, experts=0,
                       experts_per_token=0, expert_width=0, shared_expert_width=0, sparse_layers=(False, False))
    per_token = 2 * (2 * (8 * 8 * 2 + 8 * 4 * 2 + 3 * 8 * 12) + 8 * 16)
    assert forward_flops(shape, 3, 5) == 3 * per_token + 4 * 3 * 5 * 2 * 2 * 4
    assert sequence_flops(shape, 2, 7) == forward_flops(shape, 14, 4)
    work = decode_work(shape, prompts=2, prompt_len=4, n=3, response_len=5, slots=4, weight_bytes_per_device=100,
                       cache_itemsize=2, slots_per_device=2)
    assert work.decode_steps == 8  # 2 x 3 samples x 5 tokens over 4 slots
    assert work.step_bytes_per_device == 100 + 2 * 8 * (2 * 2 * 1 * 4 * 2)  # weights + 2 slots x 8 columns
