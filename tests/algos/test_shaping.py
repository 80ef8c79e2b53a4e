"""Score and advantage shaping (ROLL's RLVR options) and ROLL's reinforce estimator vs float64 NumPy references
written from ROLL's formulas (roll/utils/functionals.py: reward_norm, compute_reinforce_return, masked_whiten,
difficulty_mask, get_sample_level_mask, compute_advantage)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos import (clip_symmetric, compute_advantages, normalize_scores, sample_mask, whiten_by_segment)

from .algos_testdata import ATOL, RTOL, ragged_mask

B, T, N = 12, 7, 4  # ROLL's groups: N consecutive samples of one prompt


def roll_reward_norm(r, n, mean_type, std_type):
    """ROLL's reward_norm on one domain's batch (consecutive groups of n), float64."""
    g = r.reshape(-1, n)
    mean = {"batch": r.mean(), "group": g.mean(-1, keepdims=True), None: 0.0}[mean_type]
    std = {"batch": r.std(ddof=1), "group": g.std(ddof=1, axis=-1, keepdims=True), None: None}[std_type]
    base = g if mean_type == "group" else r
    out = base - mean if std is None else (base - mean) / (std + 1e-6)
    return np.asarray(out).reshape(r.shape)


@pytest.mark.parametrize("mean_type,std_type", [("group", "group"), ("batch", "batch"), ("group", None),
                                                (None, "batch"), ("batch", None), ("group", "batch")])
def test_normalize_scores_is_rolls_reward_norm(mean_type, std_type):
    rng = np.random.default_rng(3)
    r = rng.normal(size=B) * 3 + 1
    ids = np.repeat(rng.choice(1000, size=B // N, replace=False), N).astype(np.int32)
    got = normalize_scores(jnp.asarray(r, jnp.float32), jnp.asarray(ids), jnp.zeros(B, jnp.int32), mean_type,
                           std_type)
    np.testing.assert_allclose(np.asarray(got), roll_reward_norm(r, N, mean_type, std_type), rtol=RTOL, atol=ATOL)


def test_batch_statistics_are_taken_within_each_segment():
    rng = np.random.default_rng(4)
    r = rng.normal(size=B)
    seg = np.repeat([7, 2, 9], B // 3).astype(np.int32)  # ROLL normalises each domain's batch on its own
    ids = np.arange(B, dtype=np.int32) // N
    got = normalize_scores(jnp.asarray(r, jnp.float32), jnp.asarray(ids), jnp.asarray(seg), "batch", "batch")
    want = np.concatenate([roll_reward_norm(r[seg == s], N, "batch", "batch") for s in (7, 2, 9)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="mean='running'"):
        normalize_scores(jnp.asarray(r), jnp.asarray(ids), jnp.asarray(seg), "running", None)


def test_clip_symmetric_clips_and_counts():
    x = np.random.default_rng(5).normal(size=(B, T)) * 3
    got, frac = clip_symmetric(jnp.asarray(x, jnp.float32), 2.0)
    np.testing.assert_allclose(np.asarray(got), np.clip(x, -2.0, 2.0), rtol=RTOL, atol=ATOL)
    assert float(frac) == pytest.approx(((x > 2.0).sum() + (x < -2.0).sum()) / x.size)
    x32 = jnp.asarray(x, jnp.float32)
    same, zero = clip_symmetric(x32, None)
    assert same is x32 and float(zero) == 0.0


def roll_reinforce_return(r, m, gamma):
    r = r * m
    out = np.zeros_like(r)
    for i in range(r.shape[0]):
        running = 0.0
        for t in reversed(range(r.shape[1])):
            running = r[i, t] + gamma * running
            out[i, t] = running
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_is_rolls_discounted_return(gamma):
    rng = np.random.default_rng(6)
    m = ragged_mask(rng, B, T, holes=True).astype(np.float64)
    r = rng.normal(size=(B, T))
    adv, ret = compute_advantages("reinforce", token_level_rewards=jnp.asarray(r, jnp.float32),
                                  response_mask=jnp.asarray(m, jnp.float32), gamma=gamma)
    want = roll_reinforce_return(r, m, gamma) * m
    np.testing.assert_allclose(np.asarray(adv), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(ret), want, rtol=RTOL, atol=ATOL)


def roll_masked_whiten(x, m):
    mean = (x * m).sum() / (m.sum() + 1e-8)
    var = ((x - mean) ** 2 * m).sum() / (m.sum() + 1e-8) * m.sum() / (m.sum() - 1)
    return (x - mean) / np.sqrt(var + 1e-8)


def test_whiten_by_segment_is_rolls_masked_whiten_per_domain():
    rng = np.random.default_rng(7)
    m = ragged_mask(rng, B, T).astype(np.float64)
    x = rng.normal(size=(B, T)) * 2 + 0.5
    one = whiten_by_segment(jnp.asarray(x, jnp.float32), jnp.asarray(m, jnp.float32), jnp.zeros(B, jnp.int32))
    np.testing.assert_allclose(np.asarray(one) * m, roll_masked_whiten(x, m) * m, rtol=RTOL, atol=1e-4)
    seg = np.asarray([0] * 6 + [1] * 6, np.int32)
    m[6:] = 0
    m[7, 2] = 1  # one token in segment 1: its variance is undefined, so ROLL leaves it as it is
    two = np.asarray(whiten_by_segment(jnp.asarray(x, jnp.float32), jnp.asarray(m, jnp.float32), jnp.asarray(seg)))
    np.testing.assert_allclose(two[:6] * m[:6], roll_masked_whiten(x[:6], m[:6]) * m[:6], rtol=RTOL, atol=1e-4)
    np.testing.assert_allclose(two[6:], x[6:], rtol=RTOL, atol=ATOL)


def roll_sample_mask(lengths, scores, n, max_length, truncated, low, high):
    keep = np.ones(len(scores))
    if truncated:
        keep *= (lengths != max_length)
    if low is not None:
        group_mean = np.repeat(scores.reshape(-1, n).mean(-1), n)
        keep *= (group_mean > low) * (group_mean < high)
    return keep


@pytest.mark.parametrize("truncated,bounds", [(True, None), (False, (0.1, 0.95)), (True, (0.1, 0.95)),
                                              (True, (0.0, 1.0))])
def test_sample_mask_is_rolls_length_and_difficulty_masks(truncated, bounds):
    rng = np.random.default_rng(8)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[:3] = T
    scores = rng.integers(0, 2, size=B).astype(np.float64)
    scores[:N] = 1.0  # a solved group
    scores[N:2 * N] = 0.0  # a failed one
    ids = np.repeat(np.arange(B // N) * 11 + 5, N).astype(np.int32)
    keep, metrics = sample_mask(jnp.asarray(lengths), jnp.asarray(scores, jnp.float32), jnp.asarray(ids),
                                max_length=T, truncated=truncated, difficulty=bounds)
    low, high = bounds if bounds else (None, None)
    want = roll_sample_mask(lengths, scores, N, T, truncated, low, high)
    np.testing.assert_array_equal(np.asarray(keep), want)
    assert float(metrics["actor/final_mask_ratio"]) == pytest.approx(want.mean())
    if bounds:
        assert not want[:2 * N].any()  # all solved and all failed groups leave


def test_roll_pipeline_order_in_the_advantage_stage():
    """Scores clipped, token rewards, reinforce return, whitening over the kept tokens, advantages clipped: ROLL's
    compute_token_reward and compute_advantage on one domain."""
    from rlhf_jax.train.steps import advantage_stage

    rng = np.random.default_rng(9)
    m = ragged_mask(rng, B, T).astype(np.float64)
    m[0] = 0
    m[1, :3] = 1
    last = np.maximum(m.sum(-1).astype(int) - 1, 0)
    scores = rng.normal(size=B) * 8
    token = np.zeros((B, T))
    token[np.arange(B), last] = scores * (m.sum(-1) > 0)
    rewards, adv, ret, _ = advantage_stage(
        jnp.asarray(token, jnp.float32), jnp.asarray(m, jnp.float32), jnp.arange(B, dtype=jnp.int32) // N, None,
        None, None, 0.0, estimator="reinforce", gamma=0.95, lam=1.0, norm_adv_by_std_in_grpo=True,
        use_kl_in_reward=False, kl_penalty="kl", reward_clip=10.0, whiten_advantages=True, advantage_clip=2.0)
    r = np.clip(token, -10, 10)
    want = np.clip(roll_masked_whiten(roll_reinforce_return(r, m, 0.95), m) * m, -2.0, 2.0)
    np.testing.assert_allclose(np.asarray(rewards), r, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(adv), want, rtol=RTOL, atol=1e-4)
    assert np.abs(np.asarray(adv)).max() <= 2.0 + 1e-6 and (np.abs(want) == 2.0).any()
