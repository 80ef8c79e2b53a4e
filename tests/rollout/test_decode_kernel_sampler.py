"""The sampler with the Pallas decode kernels (interpret mode) gives the dense path's tokens, token for token.

Greedy decoding on tiny Llama and Qwen2 (layer 1 with a sliding window) checkpoints, with fewer slots than samples
(refilled slots) and stop tokens that end samples at different lengths. The kernels' blocks are
shrunk to a few columns so that a row's fill spans several blocks and most rows skip some.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from rlhf_jax.models import TASK_CAUSAL_LM, decode_kernels, from_pretrained, lora
from rlhf_jax.parallel import make_mesh
from rlhf_jax.rollout import Sampler, SamplingParams, left_pad

from .rollout_testdata import PAD_ID, VOCAB, build_checkpoint, ragged_prompts

R = 20


def greedy(model, graphdef, prompts, stop_ids, mesh=None, slots=3):
    params = SamplingParams(max_new_tokens=R, temperature=0.0, n=1, eos_token_ids=stop_ids, pad_token_id=PAD_ID,
                            max_num_seqs=slots, do_sample=False)
    ids, mask = left_pad(prompts, 16, len(prompts), PAD_ID)
    out = Sampler(graphdef, mesh=mesh).generate(nnx.split(model)[1], ids, mask, params)
    return np.asarray(out.responses), np.asarray(out.response_mask), np.asarray(out.logprobs)


# One token in 11 (13) ends a sample: these checkpoints' greedy samples then end after 3 to 20 tokens.
@pytest.mark.parametrize("kind, every", [("llama", 11), ("qwen2_window", 13)])
def test_sampler_with_decode_kernels_equals_dense(kind, every, tmp_path, monkeypatch):
    monkeypatch.setattr(decode_kernels, "TPU_BLOCK", 8)
    monkeypatch.setattr(decode_kernels, "GPU_BLOCK", 16)
    model = from_pretrained(build_checkpoint(kind, str(tmp_path / kind)))
    prompts = ragged_prompts(seed=7, count=6, low=2, high=15)
    stop_ids = tuple(range(3, VOCAB, every))
    tokens, mask, logprobs = greedy(model, nnx.split(model)[0], prompts, stop_ids)
    lengths = mask.sum(axis=1)
    assert len(set(lengths.tolist())) > 3, lengths
    for impl in ("pallas_tpu", "pallas_gpu"):
        cfg = model.config.replace(decode_attn_impl=impl, pallas_interpret=True)
        got_tokens, got_mask, got_logprobs = greedy(model, lora.plain_graphdef(cfg, TASK_CAUSAL_LM), prompts, stop_ids)
        np.testing.assert_array_equal(got_tokens, tokens, err_msg=impl)
        np.testing.assert_array_equal(got_mask, mask, err_msg=impl)
        np.testing.assert_allclose(got_logprobs, logprobs, atol=1e-5, err_msg=impl)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices; tests/conftest.py sets XLA_FLAGS")
def test_sampler_with_decode_kernel_per_device_equals_dense(tmp_path, monkeypatch):
    """Slots split over data=2 and kv heads over tensor=2: each device runs the kernel on its block of the cache."""
    monkeypatch.setattr(decode_kernels, "TPU_BLOCK", 8)
    mesh = make_mesh(data=2, tensor=2, devices=jax.devices()[:4])
    model = from_pretrained(build_checkpoint("llama", str(tmp_path / "llama")), mesh=mesh)
    prompts = ragged_prompts(seed=7, count=6, low=2, high=15)
    stop_ids = tuple(range(3, VOCAB, 11))
    tokens, mask, logprobs = greedy(model, nnx.split(model)[0], prompts, stop_ids, mesh, slots=2)
    assert len(set(mask.sum(axis=1).tolist())) > 3
    cfg = model.config.replace(decode_attn_impl="pallas_tpu", pallas_interpret=True)
    got_tokens, got_mask, got_logprobs = greedy(model, lora.plain_graphdef(cfg, TASK_CAUSAL_LM), prompts, stop_ids,
                                                mesh, slots=2)
    np.testing.assert_array_equal(got_tokens, tokens)
    np.testing.assert_array_equal(got_mask, mask)
    np.testing.assert_allclose(got_logprobs, logprobs, atol=1e-5)
