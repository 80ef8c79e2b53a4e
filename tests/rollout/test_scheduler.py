"""Slot count and loop sizes, and what the decode loops execute: fewer slot-steps than the static loop."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from rlhf_jax.rollout import Sampler, SamplingParams, left_pad, num_slots, scheduler
from rlhf_jax.rollout.scheduler import MAX_PHASES, QUARTER_MIN_SLOTS, phase_sizes

from .rollout_testdata import PAD_ID, ragged_prompts


def test_slot_count_follows_the_batch_and_the_shards():
    assert num_slots(64, 1) == 64  # every sample at once
    assert num_slots(1024, 1) == 256  # capped
    assert num_slots(64, 1, max_num_seqs=16) == 16
    assert num_slots(64, 4, max_num_seqs=10) == 8  # a multiple of the shard count, at most the cap
    assert num_slots(64, 4, max_num_seqs=2) == 4  # at least one slot per shard
    assert num_slots(8, 1, max_num_seqs=100) == 8  # never more than the samples


def test_loop_sizes_shrink_by_quarters_then_halve_to_one_slot_per_shard():
    assert phase_sizes(64, 1, response_len=128) == (64, 48, 36, 27, 20, 15)  # short responses: quarters only
    assert phase_sizes(8, 1, response_len=128) == (8,)
    assert phase_sizes(64, 1, 512) == (64, 48, 36, 27, 20, 15, 7, 3, 1)
    assert phase_sizes(64, 4, 512) == (64, 48, 36, 16, 8, 4)  # 16, 12, 9 per shard, then 4, 2, 1
    assert phase_sizes(8, 1, 512) == (8, 4, 2, 1)
    assert phase_sizes(1, 1, 512) == (1,)
    for slots, shards in ((256, 1), (64, 8), (96, 2), (1024, 1)):
        sizes = phase_sizes(slots, shards, 512)
        assert all(s % shards == 0 and s >= shards for s in sizes) and len(sizes) <= MAX_PHASES
        per_shard = [s // shards for s in sizes]
        for a, b in zip(per_shard, per_shard[1:]):  # a quarter fewer while enough are left, else half
            assert (b == a * 3 // 4 and b >= QUARTER_MIN_SLOTS) or b == a // 2, sizes
        assert list(sizes) == sorted(set(sizes), reverse=True)
    assert phase_sizes(256, 1, 512)[-1] > 1  # capped at MAX_PHASES loops before reaching one slot


def test_loops_execute_fewer_slot_steps_than_the_static_loop(llama_model, monkeypatch):
    """Refills and shrinking: executed steps x slots cover the tokens, with less idle work than N x (max length - 1)."""
    monkeypatch.setattr(scheduler, "HALVING_MIN_TOKENS", 32)  # the halving tail too
    graphdef, state = nnx.split(llama_model)
    sampler = Sampler(graphdef)
    prompts = ragged_prompts(seed=3, count=8)
    ids, mask = left_pad(prompts, 16, 8, PAD_ID)
    for slots in (8, 16):
        params = SamplingParams(max_new_tokens=32, temperature=1.0, n=4, eos_token_ids=(1, 9, 17), pad_token_id=PAD_ID,
                                max_num_seqs=slots)
        batch, stats = sampler.generate_with_stats(state, ids, mask, params)
        lengths = np.asarray(jax.device_get(batch.response_mask)).sum(axis=1)
        assert lengths.max() == 32 and lengths.min() < 8
        steps = jax.device_get(stats.steps)
        assert stats.slots == phase_sizes(slots, 1, 32) and stats.slots[-1] == 1 and len(steps) == len(stats.slots)
        # every token after the first comes from a decode step of a slot
        assert stats.slot_steps() >= (lengths - 1).sum()
        assert stats.slot_steps() < len(lengths) * (lengths.max() - 1)
        if slots == 8:
            assert steps[0] > 2 * 31  # refilled: the 8 slots decode 32 samples one after another
        else:
            assert steps[1:].sum() > 0  # the tail ran on fewer slots


def test_a_narrow_first_loop_draws_the_same_samples(llama_model, monkeypatch):
    """The first loop on a P + R/4 cache (then widened) draws what the whole-cache loops draw, with and without
    refills."""

    graphdef, state = nnx.split(llama_model)
    prompts = ragged_prompts(seed=5, count=8)
    ids, mask = left_pad(prompts, 16, 8, PAD_ID)
    for slots in (8, 32):
        params = SamplingParams(max_new_tokens=32, temperature=1.0, n=4, eos_token_ids=(1, 9, 17), pad_token_id=PAD_ID,
                                max_num_seqs=slots)
        runs = {}
        for narrow in (False, True):
            monkeypatch.setattr(scheduler, "NARROW_MIN_TOKENS", 8 if narrow else 10**9)
            runs[narrow] = Sampler(graphdef).generate_with_stats(state, ids, mask, params)
        (wide, wide_stats), (nar, nar_stats) = runs[False], runs[True]
        assert nar_stats.slots == (slots,) + wide_stats.slots  # the first slot count runs twice: narrow, then wide
        steps = jax.device_get(nar_stats.steps)
        wide_steps = jax.device_get(wide_stats.steps)
        assert 0 < steps[0] <= 32 // 4 + 1  # the narrow loop ends by the time responses outgrow it
        assert steps[0] + steps[1] == wide_steps[0] and (steps[2:] == wide_steps[1:]).all()  # same work, same order
        np.testing.assert_array_equal(jax.device_get(nar.responses), jax.device_get(wide.responses))
        np.testing.assert_array_equal(jax.device_get(nar.response_mask), jax.device_get(wide.response_mask))
        np.testing.assert_allclose(jax.device_get(nar.logprobs), jax.device_get(wide.logprobs), atol=1e-5)
