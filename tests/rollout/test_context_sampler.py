"""The sampler with each slot's KV cache split along its length over ``mesh.context`` samples what the unsplit one
does: the same greedy tokens, log-probs within 1e-5, on tiny Llama (context 2, 4 and 8), Qwen3 (2) and Qwen2 with a
sliding window (4: the window's count of valid keys runs across the blocks) checkpoints. Two slots serve four
prompts, so slots are refilled (a prompt copied into the blocks that hold its columns) while others decode.

Equal tokens alone would also come from a sampler that replicates the cache over the context axis, so the compiled
program is checked too: its decode cache is sharded on ``context`` and the decode loop combines the attention's
partial softmax across devices with all-reduces of per-token tensors, never gathering the cache.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx

from rlhf_jax.models import from_pretrained
from rlhf_jax.parallel import make_mesh
from rlhf_jax.parallel.mesh import DEFAULT_RULES
from rlhf_jax.rollout import SamplingParams, Sampler
from rlhf_jax.rollout.shards import BatchShards

from .rollout_testdata import PAD_ID, ragged_prompts

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; tests/conftest.py sets them")

NEW_TOKENS = 13  # a cache of P + 12 columns: P = 10 makes 22, rounded up to 24 (blocks of 12, 6 or 3 columns)
EOS = 2
# a wide init gives peaked next-token distributions, so the greedy paths have clear winners
WIDE = dict(initializer_range=0.25)
_REFERENCES: dict[tuple, object] = {}  # (kind, data) -> the unsplit sampler's batch, shared by the cases


def _left_padded(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), PAD_ID, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


def _sample(path: str, mesh, params: SamplingParams, prompts):
    model = from_pretrained(path, mesh=mesh)
    sampler = Sampler.for_model(model, mesh=mesh)
    state = nnx.split(model)[1]
    ids, mask = _left_padded(prompts)
    batch = sampler.generate(state, ids, mask, params)
    return jax.device_get(batch), sampler.compiled(state, ids.shape[0], ids.shape[1], params)


PROMPTS = ragged_prompts(seed=33, count=4, low=3, high=11)
assert max(len(p) for p in PROMPTS) == 10
# 2 slots for 4 prompts: slots are refilled, so prompts are copied into the split cache mid-loop
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, eos_token_ids=(EOS,), pad_token_id=PAD_ID,
                        max_num_seqs=2)


@pytest.mark.parametrize("kind,context", [("llama", 2), ("llama", 4), ("llama", 8), ("qwen3", 2),
                                          ("qwen2_window", 4)])
def test_split_cache_samples_what_the_unsplit_cache_does(hf_checkpoint, kind, context):
    path, _ = hf_checkpoint(kind, **WIDE)
    data = 2 if context <= 4 else 1
    if (kind, data) not in _REFERENCES:
        _REFERENCES[kind, data] = _sample(path, make_mesh(data=data, fsdp=1, devices=jax.devices()[:data]), GREEDY,
                                          PROMPTS)[0]
    reference = _REFERENCES[kind, data]
    mesh = make_mesh(data=data, fsdp=1, context=context, devices=jax.devices()[:data * context])
    split, _ = _sample(path, mesh, GREEDY, PROMPTS)
    np.testing.assert_array_equal(split.responses, reference.responses)
    np.testing.assert_array_equal(split.response_mask, reference.response_mask)
    assert reference.response_mask.sum(axis=1).max() > 8  # responses long enough to cross blocks of the cache
    np.testing.assert_allclose(split.logprobs, reference.logprobs, rtol=0, atol=1e-5)


def test_the_decode_cache_is_split_and_never_gathered(hf_checkpoint):
    path, _ = hf_checkpoint("llama", **WIDE)
    mesh = make_mesh(data=2, fsdp=1, context=4, devices=jax.devices()[:8])
    _, compiled = _sample(path, mesh, GREEDY, PROMPTS)
    shards = BatchShards(mesh, DEFAULT_RULES, num_kv_heads=2)
    keys, values = shards.cache(1, split_length=True)[0]
    assert (keys[0], keys[3], values[2]) == ("data", "context", "context")
    width = shards.cache_width(10 + NEW_TOKENS - 1)
    assert width == 24  # 22 columns rounded up to a multiple of 4
    text = compiled.as_text()
    # each device holds a quarter of the columns of its slot's keys (1 slot, 2 kv heads, head dim 16) and values
    assert re.search(r"f32\[1,2,16,6\]", text) and re.search(r"f32\[1,2,6,16\]", text)
    assert not re.search(r"f32\[1,2,16,24\]|f32\[1,2,24,16\]", text), "a device holds a whole slot's cache"
    # what crosses devices is per token: the softmax's max and sum (slots, kv heads, group), the weighted values
    # (.., head dim) and the staged keys and values; nothing floating-point is gathered
    assert not re.search(r"= (f32|bf16)\[[\d,]*\][^\n]* all-gather\(", text), "the cache is gathered"
    reduced = [tuple(map(int, s.split(","))) for s in re.findall(r"f32\[([\d,]+)\][^\n]* all-reduce\(", text)]
    assert (1, 2, 2) in reduced and (1, 2, 2, 16) in reduced
    assert all(6 not in shape and 24 not in shape for shape in reduced)
