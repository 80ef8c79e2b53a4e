"""Shared helpers of the rollout tests: tiny random HF checkpoints (built with transformers) and prompts."""

from __future__ import annotations

VOCAB = 96
EOS_ID = 1
PAD_ID = 0


def _common(seed_range: float) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        # a wide init gives peaked next-token distributions, so greedy paths have clear winners
        initializer_range=seed_range,
        bos_token_id=2,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def build_checkpoint(kind: str, path: str, seed: int = 0) -> str:
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    torch.manual_seed(seed)
    if kind == "llama":
        cfg = LlamaConfig(**_common(0.25), head_dim=16, tie_word_embeddings=False, rope_theta=10000.0)
        model = LlamaForCausalLM(cfg)
    elif kind in ("qwen2", "qwen2_window"):
        # qwen2_window: layer 0 full, layer 1 with a 6-token window
        window = dict(use_sliding_window=True, sliding_window=6, max_window_layers=1) if kind == "qwen2_window" else {}
        cfg = Qwen2Config(**_common(0.25), tie_word_embeddings=True, rope_theta=1000000.0, **window)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # non-zero q/k/v biases, so the bias path is exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.25)
    elif kind == "mistral_window":
        model = MistralForCausalLM(MistralConfig(**_common(0.25), head_dim=16, sliding_window=6))
    elif kind == "phi3_window":  # fused checkpoint tensors, RoPE on half of each head, a 6-token window
        model = Phi3ForCausalLM(Phi3Config(**_common(0.25), partial_rotary_factor=0.5, sliding_window=6))
    elif kind == "gemma2_window":  # soft caps, (1 + w) and sandwich norms, GeGLU, local layers with a 6-token window
        model = Gemma2ForCausalLM(Gemma2Config(**_common(0.25), head_dim=16, sliding_window=6,
                                               query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                               final_logit_softcapping=3.0))
    elif kind == "gemma3_window":  # q/k norms; local layer 0 (6-token window, RoPE base 100), global layer 1 (linear x4)
        rope = {"full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=100.0)}
        model = Gemma3ForCausalLM(Gemma3TextConfig(**_common(0.25), head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                                                   layer_types=["sliding_attention", "full_attention"], rope_parameters=rope))
    else:
        raise ValueError(kind)
    model.eval().save_pretrained(path)
    return path


def ragged_prompts(seed: int, count: int, low: int = 3, high: int = 14) -> list[list[int]]:
    """Random prompts of different lengths, avoiding the pad and EOS ids."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(rng.integers(low, high))).tolist() for _ in range(count)]


def left_padded_torch(prompts: list[list[int]], pad_id: int = PAD_ID):
    """Left-padded torch input_ids and attention_mask for ``transformers`` generate."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int], pad_id: int) -> list[list[int]]:
    """``transformers`` greedy generate on a left-padded batch; each row cut after its first EOS."""
    import torch

    ids, mask = left_padded_torch(prompts, pad_id)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # multi-threaded torch stalls badly when other processes share the cores
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_ids,
                pad_token_id=pad_id,
            )
    finally:
        torch.set_num_threads(threads)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        rows.append(row[:cut])
    return rows
