"""Logits parity on the real SmolLM2-135M-Instruct checkpoint with a chat-templated prompt."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rlhf_jax.models import from_pretrained


@pytest.fixture(scope="module")
def prompt_and_expected(smollm2_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    ids = np.asarray([ids], np.int64)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, ref_model(input_ids=torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("attn_impl", ["dense", "blockwise"])
def test_smollm2_logits_match_transformers(smollm2_dir, prompt_and_expected, attn_impl):
    ids, expected = prompt_and_expected
    model = from_pretrained(smollm2_dir, attn_impl=attn_impl)
    logits = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    assert np.abs(logits - expected).max() < 1e-3
    np.testing.assert_array_equal(logits.argmax(-1), expected.argmax(-1))
