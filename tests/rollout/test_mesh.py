"""Same tokens on one device and on a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices, for the same seed.

The mesh has 4 data-parallel shards, each with its own slots and queue of samples.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlhf_jax.models import from_pretrained
from rlhf_jax.parallel import make_mesh
from rlhf_jax.rollout import generate

from .rollout_testdata import PAD_ID, ragged_prompts


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; tests/conftest.py sets XLA_FLAGS")
def test_tokens_do_not_depend_on_the_mesh(llama_dir):
    mesh = make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])
    single = from_pretrained(llama_dir)
    sharded = from_pretrained(llama_dir, mesh=mesh)
    assert len(sharded.model.layers[0].self_attn.q_proj[...].sharding.device_set) == 8
    prompts = ragged_prompts(seed=21, count=8)
    # Sampled, n=8: 8 slots on one device; on the mesh the default 64 slots (16 per shard), shrinking to 12 and 9
    # per shard. Greedy: one slot per shard on the mesh, which each shard refills from its own queue.
    cases = ((dict(temperature=0.9, top_k=40, top_p=0.9, n=8, seed=3), 8, None), (dict(temperature=0.0), None, 4))
    for kw, single_slots, mesh_slots in cases:
        a = generate(single, prompts, max_new_tokens=16, eos_token_ids=(1,), pad_token_id=PAD_ID, max_num_seqs=single_slots,
                     **kw)
        b = generate(sharded, prompts, max_new_tokens=16, eos_token_ids=(1,), pad_token_id=PAD_ID, max_num_seqs=mesh_slots,
                     **kw)
        assert a.tokens == b.tokens, kw
        assert a.finished == b.finished
        for x, y in zip(a.logprobs, b.logprobs):
            np.testing.assert_allclose(x, y, atol=1e-4)  # reduction order differs across shards
        assert len(b.batch.responses.sharding.device_set) == 8
        assert b.batch.responses.sharding.spec[0] == ("data", "fsdp")
