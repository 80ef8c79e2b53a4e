"""KL estimators, straight-through variants, full KL, in-reward KL, KL loss and controllers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos import (
    apply_kl_in_reward,
    check_kl_kind,
    full_kl_from_logits,
    init_kl_controller,
    kl_loss,
    kl_penalty,
    update_kl_controller,
)

from .algos_testdata import ATOL, RTOL, ragged_mask

B, T, V = 6, 7, 11


def kl_ref(lp, ref, kind):
    """Per-element float64 reference, written from the formulas."""
    out = np.zeros_like(lp)
    for idx in np.ndindex(lp.shape):
        d = lp[idx] - ref[idx]
        if kind in ("kl", "k1"):
            out[idx] = d
        elif kind == "abs":
            out[idx] = abs(d)
        elif kind in ("mse", "k2"):
            out[idx] = 0.5 * d * d
        else:
            x = min(max(-d, -20.0), 20.0)
            out[idx] = min(max(math.exp(x) - x - 1.0, -10.0), 10.0)
    return out


KINDS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


def logps(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, T)) * scale - 2.0, rng.normal(size=(B, T)) * scale - 2.0


@pytest.mark.parametrize("kind", KINDS + [k + "+" for k in KINDS])
def test_kl_values_match_reference(kind):
    lp, ref = logps(0, scale=3.0)  # large enough that the k3 clamp at 10 is hit
    got = jax.jit(kl_penalty, static_argnums=2)(jnp.float32(lp), jnp.float32(ref), kind)
    np.testing.assert_allclose(np.asarray(got), kl_ref(lp, ref, kind.rstrip("+")), rtol=RTOL, atol=ATOL)


def test_k3_clamps_by_hand():
    lp = jnp.array([0.0, 0.0, -50.0, 50.0, 0.0])
    ref = jnp.array([0.0, -1.0, 0.0, 0.0, 2.0])
    got = np.asarray(kl_penalty(lp, ref, "k3"))
    # x = ref - lp: 0 -> 0; -1 -> e^-1; 50 -> clamp 20 -> huge -> 10; -50 -> clamp -20 -> 19 + e^-20 -> 10; 2 -> e^2 - 3.
    np.testing.assert_allclose(got, [0.0, math.exp(-1.0), 10.0, 10.0, math.exp(2.0) - 3.0], rtol=1e-6)


@pytest.mark.parametrize("kind", ["k1+", "abs+", "k3+", "low_var_kl+", "kl+"])
def test_straight_through_gradient_is_k2_gradient(kind):
    lp, ref = logps(1)
    f = lambda a, b, k: jnp.sum(kl_penalty(a, b, k) * jnp.arange(T, dtype=jnp.float32))  # noqa: E731
    g_plus = jax.grad(f, argnums=(0, 1))(jnp.float32(lp), jnp.float32(ref), kind)
    g_k2 = jax.grad(f, argnums=(0, 1))(jnp.float32(lp), jnp.float32(ref), "k2")
    for a, b in zip(g_plus, g_k2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # ... and it is (lp - ref) * weight, analytically
    np.testing.assert_allclose(np.asarray(g_plus[0]), (lp - ref) * np.arange(T), rtol=1e-5, atol=1e-5)
    # while the plain k3 gradient differs (so this test can fail)
    if kind.startswith(("k3", "low")):
        g_k3 = jax.grad(f)(jnp.float32(lp), jnp.float32(ref), "k3")
        assert np.abs(np.asarray(g_k3) - np.asarray(g_k2[0])).max() > 1e-2


def full_kl_ref(z, zr, temp=1.0):
    out = np.zeros(z.shape[:2])
    for i in range(z.shape[0]):
        for t in range(z.shape[1]):
            a, b = z[i, t] / temp, zr[i, t] / temp
            lp = a - (a.max() + np.log(np.sum(np.exp(a - a.max()))))
            lq = b - (b.max() + np.log(np.sum(np.exp(b - b.max()))))
            out[i, t] = sum(np.exp(lp[v]) * (lp[v] - lq[v]) for v in range(len(a)))
    return out


@pytest.mark.parametrize("chunk", [None, 3, T])
def test_full_kl_over_vocabulary(chunk):
    rng = np.random.default_rng(2)
    z, zr = rng.normal(size=(B, T, V)) * 2, rng.normal(size=(B, T, V)) * 2
    got = jax.jit(lambda a, b: kl_penalty(a, b, "full", chunk_size=chunk))(jnp.float32(z), jnp.float32(zr))
    np.testing.assert_allclose(np.asarray(got), full_kl_ref(z, zr), rtol=RTOL, atol=ATOL)
    got_t = full_kl_from_logits(jnp.float32(z), jnp.float32(zr), temperature=0.7, chunk_size=chunk)
    np.testing.assert_allclose(np.asarray(got_t), full_kl_ref(z, zr, 0.7), rtol=RTOL, atol=ATOL)
    # log-prob rows give the same as logits rows
    lz = jax.nn.log_softmax(jnp.float32(z))
    np.testing.assert_allclose(np.asarray(kl_penalty(lz, jnp.float32(zr), "full")), np.asarray(got), rtol=1e-5,
                               atol=1e-6)


def test_extreme_differences_are_finite_with_finite_gradients():
    lp = jnp.array([[50.0, -50.0, 0.0, 25.0]])
    ref = jnp.array([[-50.0, 50.0, 0.0, -25.0]])
    for kind in KINDS + [k + "+" for k in KINDS]:
        val = kl_penalty(lp, ref, kind)
        grads = jax.grad(lambda a, b: jnp.sum(kl_penalty(a, b, kind)), argnums=(0, 1))(lp, ref)
        assert np.isfinite(np.asarray(val)).all(), kind
        assert all(np.isfinite(np.asarray(g)).all() for g in grads), kind


def test_in_reward_kl_and_current_kl():
    rng = np.random.default_rng(3)
    m = ragged_mask(rng, B, T)
    scores = rng.normal(size=(B, T)) * m
    lp, ref = logps(4)
    rewards, cur = jax.jit(apply_kl_in_reward, static_argnums=5)(
        jnp.float32(scores), jnp.float32(lp), jnp.float32(ref), jnp.float32(m), 0.05, "low_var_kl")
    kld = kl_ref(lp, ref, "k3") * m
    np.testing.assert_allclose(np.asarray(rewards), scores - 0.05 * kld, rtol=RTOL, atol=ATOL)
    per_seq = [kld[i].sum() / m[i].sum() if m[i].sum() > 0 else 0.0 for i in range(B)]
    np.testing.assert_allclose(float(cur), np.mean(per_seq), rtol=RTOL)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_kl_loss_aggregates_and_forwards_denominator(mode):
    rng = np.random.default_rng(5)
    m = ragged_mask(rng, B, T)
    lp, ref = logps(6)
    kld = kl_ref(lp, ref, "k3")
    got = kl_loss(jnp.float32(lp), jnp.float32(ref), jnp.float32(m), "low_var_kl", mode)
    if mode == "token-mean":
        want = (kld * m).sum() / m.sum()
    else:
        want = np.mean([(kld[i] * m[i]).sum() / m[i].sum() for i in range(B) if m[i].sum() > 0])
    np.testing.assert_allclose(float(got), want, rtol=RTOL)
    half = kl_loss(jnp.float32(lp), jnp.float32(ref), jnp.float32(m), "low_var_kl", mode, denominator=2.0)
    assert abs(float(half) - float(got) * (
        m.sum() if mode == "token-mean" else (m.sum(-1) > 0).sum()) / 2.0) < 1e-4 * abs(float(half))


def test_adaptive_controller_matches_float64_loop_and_fixed_stays():
    kls = [0.3, 0.05, 0.12, 0.0, 1.0, 0.09]
    steps = [256, 256, 128, 512, 64, 256]
    beta, want = 0.01, []
    for kl, n in zip(kls, steps):
        err = min(max(kl / 0.1 - 1.0, -0.2), 0.2)
        beta *= 1.0 + err * n / 1000.0
        want.append(beta)
    state = init_kl_controller(0.01, "adaptive", target_kl=0.1, horizon=1000)
    upd = jax.jit(update_kl_controller)
    got = []
    for kl, n in zip(kls, steps):
        state = upd(state, kl, n)
        got.append(float(state["value"]))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    fixed = init_kl_controller(0.02, "fixed")
    for kl, n in zip(kls, steps):
        fixed = upd(fixed, kl, n)
    assert float(fixed["value"]) == pytest.approx(0.02, rel=1e-7)
    # checkpointable: a flat dict of arrays that round-trips through numpy
    restored = {k: jnp.asarray(np.asarray(v)) for k, v in state.items()}
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
    assert float(upd(restored, 0.2, 10)["value"]) == float(upd(state, 0.2, 10)["value"])


def test_bad_kinds_and_controller_config_raise():
    with pytest.raises(ValueError, match="low_var_kl"):
        check_kl_kind("k4")
    with pytest.raises(ValueError, match="full\\+"):
        check_kl_kind("full+")
    with pytest.raises(ValueError, match="vocab"):
        kl_penalty(jnp.zeros((2, 3)), jnp.zeros((2, 3)), "full")
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        init_kl_controller(0.1, "pid")
    with pytest.raises(ValueError, match="horizon"):
        init_kl_controller(0.1, "adaptive", horizon=0)
