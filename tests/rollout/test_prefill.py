"""Prefill in length-sorted groups and right-aligned chunks equals one forward over the whole left-padded batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.models.decoder import positions_from_mask
from rlhf_jax.parallel.mesh import DEFAULT_RULES, single_device_mesh
from rlhf_jax.rollout import left_pad, prefill_prompts
from rlhf_jax.rollout.prefill import chunk_size, group_size
from rlhf_jax.rollout.shards import BatchShards

from .rollout_testdata import PAD_ID, VOCAB


def test_chunk_and_group_sizes():
    assert [chunk_size(p) for p in (8, 16, 40, 64, 206, 256, 1024)] == [8, 16, 16, 16, 32, 32, 128]
    assert group_size(8, 16) == 8 and group_size(32, 16) == 16 and group_size(12, 32) == 6 and group_size(7, 64) == 1


@pytest.mark.parametrize("num_prompts,length", [(5, 40), (32, 128)])  # a clamped first chunk; two row groups
def test_chunked_prefill_equals_one_forward(llama_model, num_prompts, length):
    rng = np.random.default_rng(length)
    lengths = rng.integers(1, length + 1, size=num_prompts)
    lengths[0] = length
    ids, mask = left_pad([rng.integers(3, VOCAB, size=int(n)).tolist() for n in lengths], length, num_prompts, PAD_ID)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    shards = BatchShards(single_device_mesh(), DEFAULT_RULES, llama_model.config.num_key_value_heads)
    prompts = jax.jit(lambda i, m: prefill_prompts(llama_model, i, m, shards))(ids, mask)
    assert (num_prompts // prompts.group_size > 1) == (num_prompts == 32)

    full = llama_model.init_cache(num_prompts, length)
    hidden, full = llama_model.forward_cached(ids, positions_from_mask(mask), mask, full, 0)
    logits = np.asarray(llama_model.logits_from_hidden(hidden[:, -1:])[:, 0])
    rank = np.asarray(prompts.rank)
    group, row = rank // prompts.group_size, rank % prompts.group_size
    assert sorted(rank.tolist()) == list(range(num_prompts))
    assert np.all(np.diff(lengths[np.argsort(rank)]) <= 0)  # groups hold prompts of similar length, longest first
    np.testing.assert_allclose(np.asarray(prompts.logits)[group, row], logits, atol=1e-4)
    valid = np.asarray(mask).astype(bool)
    for (k, v), (fk, fv) in zip(prompts.kv, full):
        k, v = np.asarray(k)[group, row], np.asarray(v)[group, row]  # (B, K, D, P), (B, K, P, D)
        np.testing.assert_allclose(k.transpose(0, 3, 1, 2)[valid], np.asarray(fk).transpose(0, 3, 1, 2)[valid], atol=1e-4)
        np.testing.assert_allclose(v.transpose(0, 2, 1, 3)[valid], np.asarray(fv).transpose(0, 2, 1, 3)[valid], atol=1e-4)
