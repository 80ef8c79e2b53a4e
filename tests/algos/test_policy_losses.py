"""Policy losses vs float64 references, hand-checked clipping, analytic gradients, micro-batch invariance."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos import (
    LOSS_AGG_MODES,
    check_policy_loss,
    effective_loss_agg_mode,
    loss_denominator,
    policy_loss,
)

from .algos_testdata import ATOL, RTOL, agg_ref, ragged_mask

B, T = 12, 8
SPLITS = [0, 3, 6, 9, 12]  # 4 micro-batches of 3 rows each; their token counts differ (ragged masks)


def make(seed, scale=0.3):
    rng = np.random.default_rng(seed)
    m = ragged_mask(rng, B, T, holes=seed % 2 == 1).astype(np.float64)
    old = -np.abs(rng.normal(size=(B, T))) - 0.1
    lp = old + rng.normal(size=(B, T)) * scale
    adv = rng.normal(size=(B, T))
    return old, lp, adv, m


def mmean(x, m):
    n = m.sum()
    return sum(x[idx] for idx in np.ndindex(x.shape) if m[idx] > 0) / n if n > 0 else 0.0


def vanilla_ref(old, lp, A, m, lo, hi, c, mode):
    L = np.zeros_like(lp)
    cf, cfl, d_all = np.zeros_like(lp), np.zeros_like(lp), np.zeros_like(lp)
    for idx in np.ndindex(lp.shape):
        d = min(max(lp[idx] - old[idx], -20.0), 20.0)
        ratio = math.exp(d)
        l1, l2 = -A[idx] * ratio, -A[idx] * min(max(ratio, 1 - lo), 1 + hi)
        lc = max(l1, l2)
        l3 = -A[idx] * c
        L[idx] = min(l3, lc) if A[idx] < 0 else lc
        cf[idx], cfl[idx], d_all[idx] = float(l2 > l1), float(lc > l3 and A[idx] < 0), -d
    return agg_ref(L, m, mode), (mmean(cf, m), mmean(cfl, m), mmean(d_all, m))


def gspo_ref(old, lp, A, m, lo, hi):
    L, cf = np.zeros_like(lp), np.zeros_like(lp)
    for i in range(lp.shape[0]):
        n = max(m[i].sum(), 1.0)
        s = math.exp(min(sum((lp[i, t] - old[i, t]) * m[i, t] for t in range(lp.shape[1])) / n, 10.0))
        for t in range(lp.shape[1]):
            l1, l2 = -A[i, t] * s, -A[i, t] * min(max(s, 1 - lo), 1 + hi)
            L[i, t], cf[i, t] = max(l1, l2), float(l2 > l1)
    return agg_ref(L, m, "seq-mean-token-mean"), (mmean(cf, m), 0.0, mmean(old - lp, m))


def cispo_ref(old, lp, A, m, lo, hi, mode):
    L, cf = np.zeros_like(lp), np.zeros_like(lp)
    for idx in np.ndindex(lp.shape):
        ratio = math.exp(min(max(lp[idx] - old[idx], -20.0), 20.0))
        cl = min(max(ratio, 1 - lo), 1 + hi)
        L[idx], cf[idx] = -cl * A[idx] * lp[idx], float(cl != ratio)
    return agg_ref(L, m, mode), (mmean(cf, m), 0.0, mmean(old - lp, m))


def kl_cov_ref(old, lp, A, m, ratio_k, coef, mode):
    valid = [idx for idx in np.ndindex(lp.shape) if m[idx] > 0]
    ma = sum(A[v] for v in valid) / len(valid)
    ml = sum(lp[v] for v in valid) / len(valid)
    cov = {v: (A[v] - ma) * (lp[v] - ml) for v in valid}
    k = max(1, int(len(valid) * ratio_k))
    top = set(sorted(valid, key=lambda v: -cov[v])[:k])
    L = np.zeros_like(lp)
    for idx in np.ndindex(lp.shape):
        d = lp[idx] - old[idx]
        L[idx] = -A[idx] * math.exp(d) + (coef * abs(d) if idx in top else 0.0)
    return agg_ref(L, m, mode), (0.0, 0.0, mmean(np.abs(lp - old), m))


@functools.lru_cache(maxsize=None)
def jitted(mode, kw):
    """One compiled function per configuration, reused across inputs of equal shape."""
    return jax.jit(lambda o, l, a, mm: policy_loss(mode, old_log_prob=o, log_prob=l, advantages=a, response_mask=mm,
                                                   **dict(kw)))


def run(mode, old, lp, A, m, **kw):
    f = jitted(mode, tuple(sorted(kw.items())))
    loss, met = f(*(jnp.float32(x) for x in (old, lp, A, m)))
    return float(loss), (float(met["pg_clipfrac"]), float(met["pg_clipfrac_lower"]), float(met["ppo_kl"]))


def check(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_vanilla_matches_reference(agg, seed):
    old, lp, A, m = make(seed, scale=1.2)  # wide enough to hit both clip bounds and the dual clip
    lo, hi, c = (0.2, 0.28, 3.0) if seed == 0 else (0.1, 0.3, 1.5)
    got = run("vanilla", old, lp, A, m, loss_agg_mode=agg, clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=c)
    want = vanilla_ref(old, lp, A, m, lo, hi, c, agg)
    check(got, want)
    assert 0 < want[1][0] < 1 and want[1][1] > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_cispo_gpg_kl_cov_match_reference(seed):
    old, lp, A, m = make(seed, scale=0.5)
    check(run("gspo", old, lp, A, m, loss_agg_mode="token-mean", clip_ratio_low=0.05, clip_ratio_high=0.1),
          gspo_ref(old, lp, A, m, 0.05, 0.1))
    check(run("cispo", old, lp, A, m, loss_agg_mode="seq-mean-token-sum"),
          cispo_ref(old, lp, A, m, 0.2, 0.2, "seq-mean-token-sum"))
    got = run("gpg", old, lp, A, m, loss_agg_mode="seq-mean-token-mean")
    np.testing.assert_allclose(got[0], agg_ref(-lp * A, m, "seq-mean-token-mean"), rtol=RTOL, atol=ATOL)
    check(run("kl_cov", old, lp, A, m, kl_cov_ratio=0.1, ppo_kl_coef=0.7),
          kl_cov_ref(old, lp, A, m, 0.1, 0.7, "token-mean"))
    check(run("kl_cov", old, lp, A, m, loss_agg_mode="seq-mean-token-sum-norm"),
          kl_cov_ref(old, lp, A, m, 2e-4, 0.1, "seq-mean-token-sum-norm"))  # verl's default coefficient


def test_dual_clip_only_acts_on_negative_advantages():
    # token: (A, ratio) -> expected loss
    A = np.array([[-1.0, 1.0, 1.0, -1.0]])
    ratio = np.array([[5.0, 0.1, 5.0, 1.1]])
    old = np.full((1, 4), -1.0)
    lp = old + np.log(ratio)
    loss_mat = []
    for j in range(4):
        mj = np.zeros((1, 4))
        mj[0, j] = 1.0
        loss_mat.append(run("vanilla", old, lp, A, mj, clip_ratio_c=3.0)[0])
    # A<0, ratio 5: L1 = 5, L2 = 1.2, max = 5, capped by -A c = 3.      A>0, ratio 0.1: max(-0.1, -0.8) = -0.1,
    # no cap (min with -A c = -3 would give -3).  A>0, ratio 5: max(-5, -1.2) = -1.2.  A<0, ratio 1.1: 1.1, below 3.
    np.testing.assert_allclose(loss_mat, [3.0, -0.1, -1.2, 1.1], rtol=1e-5)
    _, (cf, cfl, _) = run("vanilla", old, lp, A, np.ones((1, 4)), clip_ratio_c=3.0)
    assert cfl == pytest.approx(0.25)  # only the A<0, ratio 5 token hits the dual clip
    # L2 > L1 only for (A>0, ratio 5): -1.2 > -5; the others keep L1 (ties are not clipped)
    assert cf == pytest.approx(0.25)


def test_asymmetric_clip_bounds():
    A = np.array([[1.0, 1.0, -1.0, -1.0, 1.0]])
    ratio = np.array([[1.5, 1.25, 0.5, 0.95, 0.5]])
    old = np.full((1, 5), -2.0)
    lp = old + np.log(ratio)
    per_tok = []
    for j in range(5):
        mj = np.zeros((1, 5))
        mj[0, j] = 1.0
        per_tok.append(run("vanilla", old, lp, A, mj, clip_ratio_low=0.1, clip_ratio_high=0.3)[0])
    # A>0: ratio capped at 1 + 0.3 (1.5 -> 1.3; 1.25 untouched). A<0: ratio floored at 1 - 0.1 (0.5 -> 0.9;
    # 0.95 untouched). A>0 with ratio 0.5: pessimistic max(-0.5, -0.9) keeps -0.5 (no lower clip for A>0).
    np.testing.assert_allclose(per_tok, [-1.3, -1.25, 0.9, 0.95, -0.5], rtol=1e-5)


def _lp_of(w, old, x):
    return old + 0.3 * jnp.tanh(x * w[None, :])


@pytest.mark.parametrize("mode,agg", [("vanilla", a) for a in LOSS_AGG_MODES]
                         + [(m, "token-mean") for m in ("gspo", "geo_mean", "sapo", "dro", "dppo_tv", "dppo_kl")])
def test_micro_batch_gradients_sum_to_mini_batch_gradient(mode, agg):
    rng = np.random.default_rng(11)
    old, _, A, m = (jnp.float32(v) for v in make(11))
    x = jnp.float32(rng.normal(size=(B, T)) * 3)
    w = jnp.float32(rng.normal(size=T))

    def f(w, old, x, A, m, den):
        return policy_loss(mode, old_log_prob=old, log_prob=_lp_of(w, old, x), advantages=A, response_mask=m,
                           loss_agg_mode=agg, denominator=den, **({"dro_beta": 0.2} if mode == "dro" else {}))[0]

    assert len({float(m[a:b].sum()) for a, b in zip(SPLITS[:-1], SPLITS[1:])}) > 1  # uneven token counts
    vg = jax.jit(jax.value_and_grad(f))
    full_l, full_g = vg(w, old, x, A, m, None)
    den = loss_denominator(m, effective_loss_agg_mode(mode, agg))
    acc_l, acc_g, naive_g = 0.0, jnp.zeros_like(w), jnp.zeros_like(w)
    for a, b in zip(SPLITS[:-1], SPLITS[1:]):
        l_mb, g_mb = vg(w, old[a:b], x[a:b], A[a:b], m[a:b], den)
        acc_l, acc_g = acc_l + l_mb, acc_g + g_mb
        naive_g = naive_g + vg(w, old[a:b], x[a:b], A[a:b], m[a:b], None)[1] * (b - a) / B
    np.testing.assert_allclose(float(acc_l), float(full_l), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(acc_g), np.asarray(full_g), rtol=0, atol=1e-6)
    assert np.abs(np.asarray(naive_g) - np.asarray(full_g)).max() > 1e-4


def test_gspo_forces_seq_mean_token_mean_and_has_the_sequence_gradient():
    old, lp, A, m = make(3, scale=0.3)
    assert effective_loss_agg_mode("gspo", "token-mean") == "seq-mean-token-mean"
    assert effective_loss_agg_mode("vanilla", "token-mean") == "token-mean"
    f = lambda l: policy_loss("gspo", old_log_prob=jnp.float32(old), log_prob=l, advantages=jnp.float32(A),  # noqa
                              response_mask=jnp.float32(m), clip_ratio_low=0.03, clip_ratio_high=0.03)[0]
    g = np.asarray(jax.grad(f)(jnp.float32(lp)))
    # d/dlogp_{i,t} = -A s_i [branch not clipped] / (|y_i| * #sequences)
    nseq = (m.sum(-1) > 0).sum()
    want = np.zeros_like(lp)
    for i in range(B):
        if m[i].sum() == 0:
            continue
        s = math.exp(((lp[i] - old[i]) * m[i]).sum() / m[i].sum())
        for t in range(T):
            l1, l2 = -A[i, t] * s, -A[i, t] * min(max(s, 0.97), 1.03)
            if m[i, t] > 0 and not l2 > l1:
                want[i, t] = -A[i, t] * s / m[i].sum() / nseq
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
    assert (want == 0).sum() > (m == 0).sum()  # some tokens really are clipped


def test_vanilla_gradient_is_zero_where_clipped():
    old, lp, A, m = make(4, scale=0.6)
    f = lambda l: policy_loss("vanilla", old_log_prob=jnp.float32(old), log_prob=l, advantages=jnp.float32(A),  # noqa
                              response_mask=jnp.float32(m))[0]
    g = np.asarray(jax.grad(f)(jnp.float32(lp)))
    want = np.zeros_like(lp)
    for idx in np.ndindex(lp.shape):
        r = math.exp(lp[idx] - old[idx])
        l1, l2 = -A[idx] * r, -A[idx] * min(max(r, 0.8), 1.2)
        dual = A[idx] < 0 and max(l1, l2) > -A[idx] * 3.0
        if m[idx] > 0 and not l2 > l1 and not dual:
            want[idx] = -A[idx] * r / m.sum()
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_clip_cov_zeroes_a_random_subset_of_eligible_tokens():
    old, lp, A, m = make(5, scale=0.3)
    A = A * 4  # make many covariances fall inside (lb, ub)
    args = dict(old_log_prob=jnp.float32(old), advantages=jnp.float32(A), response_mask=jnp.float32(m))

    def loss_and_grad(ratio_k, key):
        f = lambda l: policy_loss("clip_cov", log_prob=l, clip_cov_ratio=ratio_k, rng=key, **args)  # noqa: E731
        (loss, met), g = jax.value_and_grad(f, has_aux=True)(jnp.float32(lp))
        return float(loss), met, np.asarray(g)

    # reference: eligible = valid, not PPO-clipped, lb < cov < ub
    valid = m > 0
    ma, ml = A[valid].mean(), lp[valid].mean()
    ratio = np.exp(lp - old)
    l1, l2 = -A * ratio, -A * np.clip(ratio, 0.8, 1.2)
    cov = (A - ma) * (lp - ml)
    eligible = valid & ~(l2 > l1) & (cov > 1.0) & (cov < 5.0)
    assert eligible.sum() >= 3
    # ratio 1: every eligible token is zeroed -> deterministic reference
    loss, met, _ = loss_and_grad(1.0, jax.random.key(0))
    np.testing.assert_allclose(loss, agg_ref(np.maximum(l1, l2) * ~eligible, m, "token-mean"), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(met["pg_clipfrac"]), eligible.sum() / m.sum(), rtol=1e-6)
    # small ratio: exactly max(1, floor(ratio * n)) eligible tokens, chosen by the key
    k = 2
    picks = []
    for seed in range(4):
        loss, met, g = loss_and_grad((k + 0.5) / m.sum(), jax.random.key(seed))
        zeroed = eligible & (g == 0)
        assert zeroed.sum() == k and float(met["pg_clipfrac"]) * m.sum() == pytest.approx(k)
        np.testing.assert_allclose(loss, agg_ref(np.maximum(l1, l2) * ~zeroed, m, "token-mean"), rtol=RTOL,
                                   atol=ATOL)
        picks.append(tuple(np.flatnonzero(zeroed)))
    assert len(set(picks)) > 1
    with pytest.raises(ValueError, match="rng"):
        policy_loss("clip_cov", log_prob=jnp.float32(lp), **args)


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "gpg", "cispo", "clip_cov", "kl_cov"])
def test_extreme_log_ratios_are_finite(mode):
    old, lp, A, m = make(6)
    lp = old + np.where(np.random.default_rng(6).random((B, T)) > 0.5, 50.0, -50.0)
    f = lambda l: policy_loss(mode, old_log_prob=jnp.float32(old), log_prob=l, advantages=jnp.float32(A),  # noqa
                              response_mask=jnp.float32(m), rng=jax.random.key(1))
    (loss, met), g = jax.value_and_grad(f, has_aux=True)(jnp.float32(lp))
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(g)).all()
    assert all(np.isfinite(float(v)) for v in met.values())


def test_unknown_loss_mode_lists_registered():
    with pytest.raises(ValueError, match="loss_mode.*gspo.*vanilla"):
        check_policy_loss("ppo")
