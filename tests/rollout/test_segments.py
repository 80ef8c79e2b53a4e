"""Partial rollouts (rollout/segments.py): a response sampled in segments takes new weights between them; each
token records the version that drew it, its log-prob is that version's own, and the training side's correction
weights follow from the recorded log-probs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlhf_jax.algos.rollout_correction import RolloutCorrection, rollout_correction
from rlhf_jax.rollout import Sampler, SamplingParams, left_pad, rollout_key
from rlhf_jax.rollout.segments import generate_in_segments, segment_lengths

from .rollout_testdata import EOS_ID, PAD_ID, ragged_prompts

TEMPERATURE, R, N_SAMPLES, SEGMENT = 1.2, 13, 2, 5


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _teacher_forced(graphdef, state, batch) -> np.ndarray:
    """log_softmax(logits / T) of every response token under ``state``, float64 (N, R)."""
    model = nnx.merge(graphdef, state)
    logits = np.asarray(model(batch.input_ids(), batch.attention_mask()))
    P = batch.prompts.shape[1]
    lp = _log_softmax64(logits[:, P - 1:P + R - 1] / TEMPERATURE)
    return np.take_along_axis(lp, np.asarray(batch.responses)[:, :, None], axis=2)[:, :, 0]


def test_segment_lengths_cover_the_response():
    assert segment_lengths(13, 5) == [5, 5, 3]
    assert segment_lengths(4, 8) == [4]


def test_a_sequence_spanning_an_update_records_both_versions_and_its_correction_matches_float64(llama_model):
    graphdef, old = nnx.split(llama_model)
    noise = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(old))))
    new = jax.tree.map(lambda x: x + 0.08 * jax.random.normal(next(noise), x.shape, x.dtype), old)
    sampler = Sampler(graphdef, max_positions=llama_model.config.max_position_embeddings)
    ids, mask = left_pad(ragged_prompts(seed=3, count=4), 16, 4, PAD_ID)
    params = SamplingParams(max_new_tokens=R, temperature=TEMPERATURE, n=N_SAMPLES, eos_token_ids=(EOS_ID,),
                            pad_token_id=PAD_ID)
    calls, drawn = [], []

    @jax.jit
    def slowly(batch):  # the segment's outputs come 0.1-0.5 s after the call returns (dispatch is asynchronous)
        m = jax.random.normal(jax.random.key(0), (512, 512))
        work = jax.lax.fori_loop(0, 40, lambda _, x: jnp.tanh(x @ m), m).sum()
        return jax.tree.map(lambda a: a + (0 * work).astype(a.dtype), batch)

    def generate(*args):
        drawn.append(slowly(sampler.generate(*args)))
        return drawn[-1]

    def refresh():  # the update arrives after the first segment
        # asked at the boundary itself: the segment before it has been computed, not just dispatched
        calls.append(all(leaf.is_ready() for leaf in jax.tree.leaves(drawn[-1])))
        return (new, 8) if len(calls) == 1 else None

    batch, used = generate_in_segments(generate, old, 7, jnp.asarray(ids), jnp.asarray(mask), params,
                                       rollout_key(0), SEGMENT, refresh)
    assert used == [7, 8, 8] and calls == [True, True]
    b = jax.device_get(batch)
    live = b.response_mask.astype(bool)
    cols = np.arange(R)[None, :]
    # the per-token record: version 7 before the swap, 8 after it, -1 where nothing was drawn
    np.testing.assert_array_equal(b.versions, np.where(live, np.where(cols < SEGMENT, 7, 8), -1))
    spanning = live[:, SEGMENT] & live[:, 0]
    assert spanning.sum() >= 4, "few sequences outlived the first segment: the test would show little"
    # a sample's tokens are contiguous from column 0, ending at EOS (finished) or at R
    lengths = live.sum(1)
    assert np.all(live == (cols < lengths[:, None]))
    ended = (b.responses[np.arange(len(lengths)), np.maximum(lengths - 1, 0)] == EOS_ID) & (lengths > 0)
    np.testing.assert_array_equal(b.finished, ended)
    # each token's log-prob is the drawing version's own (teacher-forced over the whole sequence)
    by_old, by_new = _teacher_forced(graphdef, old, batch), _teacher_forced(graphdef, new, batch)
    drawn_by = np.where(cols < SEGMENT, by_old, by_new)
    np.testing.assert_allclose(b.logprobs[live], drawn_by[live], atol=2e-4, rtol=0)
    assert np.abs(by_old - by_new)[live & (cols >= SEGMENT)].mean() > 1e-2  # the versions do differ
    # the training side (π_old = version 8) corrects each token with its recorded behaviour log-prob
    threshold = 2.0
    weights, _, _ = rollout_correction(jnp.asarray(by_new, jnp.float32), batch.logprobs, batch.response_mask,
                                       RolloutCorrection(rollout_is="token", rollout_is_threshold=threshold))
    ref = np.where(live, np.minimum(np.exp(by_new - b.logprobs.astype(np.float64)), threshold), 0.0)
    np.testing.assert_allclose(np.asarray(weights), ref, rtol=1e-5, atol=1e-6)
    # tokens the update drew are on-policy for version 8 (weight 1); the ones before it are not
    np.testing.assert_allclose(ref[live & (cols >= SEGMENT)], 1.0, atol=5e-4)
    assert np.abs(ref[live & (cols < SEGMENT)] - 1.0).max() > 0.05


def test_a_further_batch_of_dynamic_sampling_starts_with_the_newest_weights(llama_model):
    """Dynamic sampling draws further batches with the same SegmentedSampler: once an update was taken between
    segments, a later batch starts with it (its tokens record the newer version only), and ``used`` lists every
    segment of both batches."""
    from rlhf_jax.rollout.segments import SegmentedSampler

    graphdef, old = nnx.split(llama_model)
    new = jax.tree.map(lambda x: x * 1.05, old)
    sampler = Sampler(graphdef, max_positions=llama_model.config.max_position_embeddings)
    ids, mask = left_pad(ragged_prompts(seed=3, count=2), 16, 4, PAD_ID)
    params = SamplingParams(max_new_tokens=R, temperature=TEMPERATURE, n=N_SAMPLES, eos_token_ids=(),
                            pad_token_id=PAD_ID)
    offers = iter([(new, 8)])
    segmented = SegmentedSampler(sampler, SEGMENT, 7, lambda: next(offers, None))
    first = segmented.generate(old, ids, mask, params, rollout_key(0, 0))
    assert set(np.unique(np.asarray(first.versions))) == {7, 8}  # the update arrived after the first segment
    second = segmented.generate(old, ids, mask, params, rollout_key(0, 1))  # passed the old weights: not used
    assert set(np.unique(np.asarray(second.versions))) == {8}
    assert segmented.used == [7, 8, 8, 8, 8, 8]
    # its first segment is what the newer weights draw with the same key (later segments fold the key anew)
    whole = sampler.generate(new, ids, mask, params, rollout_key(0, 1))
    np.testing.assert_array_equal(np.asarray(second.responses)[:, :SEGMENT], np.asarray(whole.responses)[:, :SEGMENT])
    np.testing.assert_allclose(np.asarray(second.logprobs)[:, :SEGMENT], np.asarray(whole.logprobs)[:, :SEGMENT],
                               atol=2e-5)
