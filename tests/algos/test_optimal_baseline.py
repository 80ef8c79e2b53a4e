"""verl's optimal token baseline (``optimal_token_baseline``, ``tir_optimal_token_baseline``) against float64 loops
written from verl's compute_optimal_token_baseline_advantage and compute_multi_turn_optimal_token_baseline_advantage
(commit 1dda039): per group and position B = sum G W / (sum W + 1e-8), no baseline for a group of one, none for the
one longest sample past the second-longest length."""

from __future__ import annotations

import numpy as np
import pytest

from rlhf_jax.algos import compute_advantages

EPS = 1e-8


def _returns_w(r, m, old, spsq, isw):
    returns = np.flip(np.cumsum(np.flip(r * m, -1), -1), -1)
    w = 1 - 2 * np.exp(old) + spsq
    if isw is not None:
        w = w * isw**2
    return returns, np.cumsum(w * m, -1)


def otb_ref(r, m, old, spsq, index, isw=None):
    returns, wc = _returns_w(r, m, old, spsq, isw)
    base = np.zeros_like(returns)
    groups: dict = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    for rows in groups.values():
        if len(rows) == 1:
            continue
        num = (returns[rows] * wc[rows] * m[rows]).sum(0)
        den = (wc[rows] * m[rows]).sum(0) + EPS
        base[rows] = num / den
        lengths = m[rows].sum(-1)
        srt = np.sort(lengths)
        longest = [j for j, n in zip(rows, lengths) if n == srt[-1]]
        if len(longest) == 1 and srt[-1] > srt[-2]:
            base[longest[0], int(srt[-2]):] = 0.0
    return (returns - base) * m, returns


def tir_ref(r, m, old, spsq, index, isw=None):
    returns, wc = _returns_w(r, m, old, spsq, isw)
    lengths = m.sum(-1).astype(int)
    L = int(lengths.max())
    W, G = np.zeros((len(r), L)), np.zeros((len(r), L))
    for i in range(len(r)):
        if lengths[i]:
            W[i, :lengths[i]] = wc[i, m[i] > 0]
            G[i, :lengths[i]] = returns[i, m[i] > 0]
    groups: dict = {}
    for i, g in enumerate(index):
        if lengths[i]:
            groups.setdefault(g, []).append(i)
    base = np.zeros_like(G)
    for rows in groups.values():
        if len(rows) == 1:
            continue
        base[rows] = (G[rows] * W[rows]).sum(0) / (W[rows].sum(0) + EPS)
        srt = np.sort(lengths[rows])
        longest = [j for j in rows if lengths[j] == srt[-1]]
        if len(longest) == 1 and srt[-1] > srt[-2]:
            base[longest[0], srt[-2]:] = 0.0
    adv = np.zeros_like(returns)
    for i in range(len(r)):
        if lengths[i]:
            adv[i, m[i] > 0] = (G - base)[i, :lengths[i]]
    return adv * m, returns


def make(seed, holes):
    rng = np.random.default_rng(seed)
    n, T = 12, 9
    index = np.repeat(np.arange(4), 3)
    index[-1] = 99  # a group of one
    lengths = rng.integers(0, T + 1, size=n)
    lengths[0], lengths[1], lengths[2] = 7, 4, 4  # group 0: one longest sample
    lengths[3], lengths[4] = 6, 6  # group 1: two longest samples (no zero tail)
    m = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    if holes:  # tool responses inside a multi-turn response are not trained
        m = m * (rng.random((n, T)) > 0.3)
    r = np.zeros((n, T))
    last = np.maximum(m.shape[1] - 1 - np.argmax(m[:, ::-1] > 0, -1), 0)
    r[np.arange(n), last] = rng.normal(size=n) * (m.sum(-1) > 0)
    r += rng.normal(size=(n, T)) * 0.1 * m  # token-level rewards too (a KL penalty, say)
    old = -np.abs(rng.normal(size=(n, T))) - 0.05
    spsq = rng.uniform(0.05, 0.9, size=(n, T))
    isw = rng.uniform(0.5, 2.0, size=(n, T))
    return r, m, old, spsq, index, isw


def run(name, r, m, old, spsq, index, isw):
    adv, ret = compute_advantages(name, token_level_rewards=np.float32(r), response_mask=np.float32(m),
                                  group_ids=np.int32(index), old_log_probs=np.float32(old),
                                  sum_pi_squared=np.float32(spsq),
                                  rollout_is_weights=None if isw is None else np.float32(isw))
    return np.asarray(adv, np.float64), np.asarray(ret, np.float64)


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_optimal_token_baseline_matches_verls_loops(seed, with_weights):
    r, m, old, spsq, index, isw = make(seed, holes=False)
    isw = isw if with_weights else None
    want = otb_ref(r, m, old, spsq, index, isw)
    got = run("optimal_token_baseline", r, m, old, spsq, index, isw)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert np.abs(want[0]).sum() > 0 and not np.allclose(want[0], want[1] * m)  # a real baseline was subtracted


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("seed", [3, 4])
def test_tir_optimal_token_baseline_matches_verls_loops(seed, holes):
    r, m, old, spsq, index, isw = make(seed, holes=holes)
    want = tir_ref(r, m, old, spsq, index, isw)
    got = run("tir_optimal_token_baseline", r, m, old, spsq, index, isw)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_the_zero_tail_and_the_group_of_one():
    r, m, old, spsq, index, _ = make(5, holes=False)
    adv, ret = run("optimal_token_baseline", r, m, old, spsq, index, None)
    np.testing.assert_allclose(adv[-1], ret[-1] * m[-1], rtol=1e-6)  # a group of one: no baseline
    np.testing.assert_allclose(adv[0, 4:7], ret[0, 4:7], rtol=1e-6)  # the longest (7) past the second (4)
    assert not np.allclose(adv[0, :4], ret[0, :4])


def test_without_the_sum_of_squares_the_estimator_names_what_it_needs():
    r, m, old, spsq, index, _ = make(0, holes=False)
    with pytest.raises(ValueError, match="'optimal_token_baseline' needs the old policy's log-probs and sum_pi_squared"):
        compute_advantages("optimal_token_baseline", token_level_rewards=r, response_mask=m, group_ids=index)
