"""Policy losses of verl's newer releases against float64 references written from verl's formulas: GMPO
(``geo_mean``, also its gradient against finite differences) and SAPO (``sapo``). Each also runs one CLI step
(tests/train/test_new_policy_losses_cli.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos import loss_denominator, policy_loss

from .algos_testdata import ATOL, RTOL, agg_ref
from .test_policy_losses import make, mmean, run


def geo_mean_ref(old, lp, A, m, lo, hi, w=None):
    """verl: per row, sgn*min(sgn*d, sgn*clamp(d, -lo, hi)) averaged over the row's tokens, ratio = exp of that,
    loss = -mean_t(A) * ratio (times the geometric mean of the row's weights); the mean over rows with a response."""
    rows, cf, cfl = [], np.zeros_like(lp), np.zeros_like(lp)
    for i in range(lp.shape[0]):
        n = m[i].sum()
        kept_sum, adv_sum, logw = 0.0, 0.0, 0.0
        for t in range(lp.shape[1]):
            if m[i, t] == 0:
                continue
            d = lp[i, t] - old[i, t]
            c = min(max(d, -lo), hi)
            s = math.copysign(1.0, A[i, t]) if A[i, t] != 0 else 0.0
            kept_sum += s * min(s * d, s * c)
            adv_sum += A[i, t]
            logw += math.log(w[i, t] + 1e-10) if w is not None else 0.0
            cf[i, t], cfl[i, t] = float(d != c and A[i, t] > 0), float(d != c and A[i, t] < 0)
        if n == 0:
            continue  # verl's torch.mean would count this row (with a zero loss); rlhf_jax does not
        rows.append(-(adv_sum / n) * math.exp(kept_sum / n) * math.exp(logw / n))
    return sum(rows) / len(rows), (mmean(cf, m), mmean(cfl, m), mmean(old - lp, m))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_geo_mean_matches_reference(seed):
    old, lp, A, m = make(seed, scale=0.4)
    lo, hi = (0.2, 0.28) if seed else (0.1, 0.1)
    want = geo_mean_ref(old, lp, A, m, lo, hi)
    for agg in ("token-mean", "seq-mean-token-sum"):  # GMPO ignores the configured aggregation
        got = run("geo_mean", old, lp, A, m, loss_agg_mode=agg, clip_ratio_low=lo, clip_ratio_high=hi)
        np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)
    assert want[1][0] > 0 and want[1][1] > 0  # both clip sides are exercised


def test_geo_mean_with_rollout_weights_matches_reference():
    old, lp, A, m = make(5, scale=0.4)
    w = np.random.default_rng(5).uniform(0.2, 2.0, size=lp.shape)
    loss, _ = policy_loss("geo_mean", old_log_prob=jnp.float32(old), log_prob=jnp.float32(lp),
                          advantages=jnp.float32(A), response_mask=jnp.float32(m), clip_ratio_low=0.2,
                          clip_ratio_high=0.2, rollout_is_weights=jnp.float32(w))
    np.testing.assert_allclose(float(loss), geo_mean_ref(old, lp, A, m, 0.2, 0.2, w)[0], rtol=RTOL, atol=ATOL)


def test_geo_mean_gradient_matches_finite_differences():
    old, lp, A, m = (np.float32(x) for x in make(3, scale=0.4))
    den = loss_denominator(jnp.float32(m), "seq-mean-token-mean")

    def loss(x):
        return policy_loss("geo_mean", old_log_prob=jnp.float32(old), log_prob=x, advantages=jnp.float32(A),
                           response_mask=jnp.float32(m), denominator=den)[0]

    grad = np.asarray(jax.grad(loss)(jnp.float32(lp)))
    assert np.all(grad[m == 0] == 0) and np.any(grad != 0)
    eps = 1e-2
    for idx in list(zip(*np.nonzero(m)))[:12]:
        up, down = lp.copy(), lp.copy()
        up[idx] += eps
        down[idx] -= eps
        numeric = (float(loss(jnp.float32(up))) - float(loss(jnp.float32(down)))) / (2 * eps)
        d = lp[idx] - old[idx]
        if min(abs(d + 0.2), abs(d - 0.2)) < 2 * eps:
            continue  # at a clip boundary the loss has a kink
        np.testing.assert_allclose(grad[idx], numeric, rtol=2e-2, atol=2e-4)


def sapo_ref(old, lp, A, m, tau_pos, tau_neg):
    """verl: gate = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg, loss = -gate * A, mean
    over a sequence's tokens, then over sequences; r = exp(clamp(log-ratio, -20, 20))."""
    rows = []
    for i in range(lp.shape[0]):
        n = m[i].sum()
        if n == 0:
            continue
        total = 0.0
        for t in range(lp.shape[1]):
            if m[i, t] == 0:
                continue
            r = math.exp(min(max(lp[i, t] - old[i, t], -20.0), 20.0))
            tau = tau_pos if A[i, t] > 0 else tau_neg
            total += -A[i, t] * (4.0 / tau) / (1.0 + math.exp(-tau * (r - 1.0)))
        rows.append(total / n)
    return sum(rows) / len(rows), (0.0, 0.0, mmean(old - lp, m))


@pytest.mark.parametrize("seed, taus", [(0, (1.0, 1.05)), (1, (0.5, 2.0)), (2, (3.0, 0.7))])
def test_sapo_matches_reference(seed, taus):
    old, lp, A, m = make(seed, scale=0.8)
    want = sapo_ref(old, lp, A, m, *taus)
    for agg in ("token-mean", "seq-mean-token-sum"):  # SAPO always aggregates seq-mean-token-mean
        got = run("sapo", old, lp, A, m, loss_agg_mode=agg, tau_pos=taus[0], tau_neg=taus[1])
        np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)


def test_sapo_gate_has_the_ratios_slope_at_one():
    """At r = 1 the gate is 2/tau and its derivative in r is 1 whatever tau: small steps move like PPO's."""
    for tau in (0.5, 1.0, 3.0):
        def loss(x):
            return policy_loss("sapo", old_log_prob=jnp.zeros((1, 1)), log_prob=x, advantages=-jnp.ones((1, 1)),
                               response_mask=jnp.ones((1, 1)), tau_pos=tau, tau_neg=tau)[0]
        np.testing.assert_allclose(float(loss(jnp.zeros((1, 1)))), 2.0 / tau, rtol=1e-6)
        np.testing.assert_allclose(float(jax.grad(loss)(jnp.zeros((1, 1)))[0, 0]), 1.0, rtol=1e-6)


def dro_ref(old, lp, A, m, beta, mode):
    """verl: -(log pi * A - beta / 2 * (log pi - log pi_old)^2), aggregated with loss_agg_mode."""
    L = -(lp * A - 0.5 * beta * (lp - old) ** 2)
    return agg_ref(L, m, mode), (0.0, 0.0, mmean(old - lp, m))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_dro_matches_reference(mode):
    old, lp, A, m = make(4, scale=0.6)
    got = run("dro", old, lp, A, m, loss_agg_mode=mode, dro_beta=0.3)
    want = dro_ref(old, lp, A, m, 0.3, mode)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="dro_beta must be > 0"):
        run("dro", old, lp, A, m, dro_beta=0.0)


def dppo_ref(old, lp, A, m, lo, hi, c, mode, kind):
    """verl: -A * min(r, c) * log pi on the tokens inside the trust region (TV: the probability moved by at most hi
    up for A > 0, lo down otherwise; KL: the Bernoulli KL within hi / lo, or the move went the safe way)."""
    L, out, over = np.zeros_like(lp), np.zeros_like(lp), np.zeros_like(lp)
    for idx in np.ndindex(lp.shape):
        d = min(max(lp[idx] - old[idx], -20.0), 20.0)
        r = math.exp(d)
        p, q = math.exp(lp[idx]), math.exp(old[idx])
        if kind == "tv":
            ok = (p - q <= hi) if A[idx] > 0 else (p - q >= -lo)
        else:
            kl = q * (old[idx] - lp[idx]) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
            ok = (kl <= hi or p <= q) if A[idx] > 0 else (kl <= lo or p >= q)
        L[idx] = -A[idx] * min(r, c) * lp[idx] * float(ok)
        out[idx], over[idx] = float(not ok), float(r > c and ok)
    return agg_ref(L, m, mode), (mmean(out, m), mmean(over, m), mmean(old - lp, m))


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_dppo_matches_reference(kind, mode):
    old, lp, A, m = make(6, scale=1.0)
    old = np.log(np.random.default_rng(6).uniform(0.05, 0.95, size=old.shape))  # probabilities across (0, 1)
    lp = np.minimum(old + np.random.default_rng(7).normal(size=old.shape) * 0.6, np.log(0.99))  # log-probs < 0
    lo, hi, c = 0.1, 0.15, 2.0
    got = run(f"dppo_{kind}", old, lp, A, m, loss_agg_mode=mode, clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=c)
    want = dppo_ref(old, lp, A, m, lo, hi, c, mode, kind)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)
    assert 0 < want[1][0] < 1 and want[1][1] > 0  # tokens outside the region and truncated ratios both occur
