"""Logit processors and the draw, on hand-made logits, against float64 NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.rollout import SamplingParams, inverse_cdf, register_processor, rollout_key, sample_step
from rlhf_jax.rollout.processors import PROCESSORS, nucleus_threshold_bisect
from rlhf_jax.rollout.sampling import first_argmax, row_keys, sample_in_row_chunks, sample_keys

DRAWS = 4000


def np_softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max())
    return z / z.sum()


def np_allowed(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Float64 reference: probabilities after temperature, top-k, then top-p renormalised over top-k."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(x.shape, bool)
    keep[order[: top_k if top_k > 0 else len(x)]] = True
    p = np_softmax(np.where(keep, x, -np.inf))
    sorted_p = p[order]
    before = np.cumsum(sorted_p) - sorted_p
    nucleus = order[(before < top_p) & keep[order]]
    final = np.zeros(x.shape, bool)
    final[nucleus] = True
    final[order[0]] = True
    q = np.where(final, p, 0.0)
    return q / q.sum()


def draw_many(logits: np.ndarray, params: SamplingParams, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (DRAWS, logits.shape[0]))
    fn = jax.jit(lambda l, k: sample_step(l, row_keys(k, DRAWS), 3, params))
    tokens, logps = fn(rows, rollout_key(seed))
    return np.asarray(tokens), np.asarray(logps)


HAND_MADE = np.array([2.0, -1.0, 0.5, 3.1, 1.7, -3.0, 0.0, 2.6, -0.4, 1.1, 0.3, -2.2], np.float32)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 3, 1.0), (1.0, -1, 0.6), (0.7, 5, 0.5), (1.3, 0, 0.9), (1.0, -1, 1.0), (2.0, 1, 1.0)],
)
def test_draws_stay_in_allowed_set_and_match_frequencies(temperature, top_k, top_p):
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, logps = draw_many(HAND_MADE, params)
    ref = np_allowed(HAND_MADE, temperature, top_k, top_p)
    allowed = set(np.flatnonzero(ref > 0).tolist())
    assert set(tokens.tolist()) <= allowed
    if top_k > 0:
        assert len(allowed) <= top_k
    freq = np.bincount(tokens, minlength=len(HAND_MADE)) / DRAWS
    sigma = np.sqrt(ref * (1 - ref) / DRAWS)
    assert np.all(np.abs(freq - ref) <= 5 * sigma + 1e-3), (freq, ref)
    # the reported log-prob is that of the temperature-scaled, untruncated distribution
    full = np.log(np_softmax(HAND_MADE.astype(np.float64) / temperature))
    np.testing.assert_allclose(logps, full[tokens], atol=1e-5)


def test_top_p_on_a_wide_flat_vocabulary_uses_the_exact_fallback():
    """A nucleus wider than the fast top-256 path: the sort-free bisection must pick the exact set."""
    rng = np.random.default_rng(3)
    logits = (0.3 * rng.standard_normal(3000)).astype(np.float32)
    params = SamplingParams(max_new_tokens=1, top_p=0.5)
    ref = np_allowed(logits, 1.0, -1, 0.5)
    assert (ref > 0).sum() > 256
    tokens, _ = draw_many(logits, params, seed=5)
    assert set(tokens.tolist()) <= set(np.flatnonzero(ref > 0).tolist())


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.999])
def test_nucleus_threshold_bisect_matches_sorted_reference(top_p):
    rng = np.random.default_rng(int(top_p * 1000))
    logits = (rng.standard_normal((6, 1500)) * rng.uniform(0.2, 4.0, size=(6, 1))).astype(np.float32)
    got = np.asarray(jax.jit(nucleus_threshold_bisect, static_argnums=1)(jnp.asarray(logits), top_p))
    for row, threshold in zip(logits, got):
        ref = np_allowed(row, 1.0, -1, top_p)
        assert threshold == row[ref > 0].min()


def test_inverse_cdf_matches_float64_searchsorted():
    rng = np.random.default_rng(7)
    for width in (17, 700, 5003):  # one level; one level at the limit; two levels with a ragged last chunk
        w = rng.exponential(size=(64, width)).astype(np.float32)
        w[:, rng.random(width) < 0.3] = 0.0
        u = rng.random(64).astype(np.float32)
        got = np.asarray(jax.jit(inverse_cdf)(jnp.asarray(w), jnp.asarray(u)))
        cdf = np.cumsum(w.astype(np.float64), axis=1)
        target = u.astype(np.float64) * cdf[:, -1]
        ref = np.array([np.searchsorted(c, t, side="right") for c, t in zip(cdf, target)])
        # rows whose target sits within float32 rounding of a CDF step may legitimately differ
        margin = np.min(np.abs(cdf - target[:, None]), axis=1) / cdf[:, -1]
        clear = margin > 1e-5
        assert clear.sum() > 50
        np.testing.assert_array_equal(got[clear], ref[clear])
        assert np.all(w[np.arange(64), got] > 0)


def test_inverse_cdf_never_returns_zero_weight_at_the_extremes():
    w = np.zeros((4, 3000), np.float32)
    w[:, 10] = 1.0
    w[:, 2500] = 3.0
    u = np.array([0.0, 0.2499, 0.25, np.nextafter(np.float32(1.0), np.float32(0.0))], np.float32)
    got = np.asarray(inverse_cdf(jnp.asarray(w), jnp.asarray(u)))
    np.testing.assert_array_equal(got, [10, 10, 2500, 2500])


def test_low_temperature_equals_greedy_and_seeds():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((32, 50)) * 3, jnp.float32)
    greedy_tok, _ = sample_step(logits, row_keys(rollout_key(0), 32), 0, SamplingParams(max_new_tokens=1, temperature=0.0))
    np.testing.assert_array_equal(greedy_tok, np.argmax(np.asarray(logits), axis=1))
    cold = SamplingParams(max_new_tokens=1, temperature=1e-3)
    cold_tok, _ = sample_step(logits, row_keys(rollout_key(9), 32), 0, cold)
    np.testing.assert_array_equal(cold_tok, greedy_tok)
    warm = SamplingParams(max_new_tokens=1, temperature=1.0)
    a = sample_step(logits, row_keys(rollout_key(1), 32), 0, warm)[0]
    b = sample_step(logits, row_keys(rollout_key(1), 32), 0, warm)[0]
    c = sample_step(logits, row_keys(rollout_key(2), 32), 0, warm)[0]
    np.testing.assert_array_equal(a, b)
    assert np.any(np.asarray(a) != np.asarray(c))


def test_custom_processor_registers_and_composes():
    name = "ban_token_3_for_test"
    if name not in PROCESSORS:

        @register_processor(name)
        def ban(candidates, params):
            return candidates.replace(logits=candidates.logits.at[:, 3].set(-jnp.inf))

    params = SamplingParams(max_new_tokens=1, processors=("temperature", name, "top_k"), top_k=2)
    tokens, _ = draw_many(HAND_MADE, params)
    assert set(tokens.tolist()) == {0, 7}  # 3 (the best) is banned; top-2 of the rest
    with pytest.raises(ValueError, match="unknown logit processor"):
        draw_many(HAND_MADE, SamplingParams(max_new_tokens=1, processors=("nope",)))


def test_draws_depend_on_sample_id_and_token_index_only():
    """A row's token is a function of (key, sample id, token index): rows may come in any order, in any chunks."""
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.standard_normal((48, 300)) * 2, jnp.float32)
    steps = jnp.asarray(rng.integers(0, 50, size=48), jnp.int32)
    params = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.9)
    key = rollout_key(2)
    tokens, logps = sample_step(logits, row_keys(key, 48), steps, params)
    perm = rng.permutation(48)
    shuffled = sample_step(logits[perm], sample_keys(key, jnp.asarray(perm)), steps[perm], params)
    np.testing.assert_array_equal(shuffled[0], np.asarray(tokens)[perm])
    for rows in (16, 7):  # 7 does not divide 48: chunks of 6
        chunked = jax.jit(lambda l, k, s, rows=rows: sample_in_row_chunks(l, k, s, params, rows))(logits, row_keys(key, 48), steps)
        np.testing.assert_array_equal(chunked[0], tokens)
        np.testing.assert_allclose(chunked[1], logps, atol=1e-6)
    one_step = sample_step(logits, row_keys(key, 48), 5, params)[0]
    np.testing.assert_array_equal(one_step, sample_step(logits, row_keys(key, 48), jnp.full((48,), 5), params)[0])


def test_first_argmax_takes_the_first_of_ties():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [-1.0, -1.0, -2.0, -1.0], [0.0, 0.0, 0.0, 5.0]])
    np.testing.assert_array_equal(first_argmax(logits), [1, 0, 3])
    rng = np.random.default_rng(0)
    wide = jnp.asarray(np.round(rng.standard_normal((16, 5000)), 1), jnp.float32)  # many ties
    np.testing.assert_array_equal(first_argmax(wide), np.argmax(np.asarray(wide), axis=1))
