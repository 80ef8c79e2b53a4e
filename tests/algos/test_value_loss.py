"""Clipped value loss vs a float64 reference, a hand case, denominators and extremes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos import LOSS_AGG_MODES, loss_denominator, value_loss

from .algos_testdata import ATOL, RTOL, agg_ref, ragged_mask

B, T = 10, 7


def value_ref(vp, v, R, m, c, mode):
    L, cf = np.zeros_like(vp), []
    for idx in np.ndindex(vp.shape):
        vc = min(max(vp[idx], v[idx] - c), v[idx] + c)
        a, b = (vp[idx] - R[idx]) ** 2, (vc - R[idx]) ** 2
        L[idx] = max(a, b)
        if m[idx] > 0:
            cf.append(float(b > a))
    return 0.5 * agg_ref(L, m, mode), np.mean(cf)


def make(seed):
    rng = np.random.default_rng(seed)
    m = ragged_mask(rng, B, T, holes=seed == 1)
    v = rng.normal(size=(B, T))
    return v + rng.normal(size=(B, T)) * 0.8, v, rng.normal(size=(B, T)), m


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_value_loss_matches_reference(mode, seed):
    vp, v, R, m = make(seed)
    c = 0.5 if seed == 0 else 0.2
    f = jax.jit(value_loss, static_argnums=(4, 5))
    loss, cf = f(*(jnp.float32(x) for x in (vp, v, R, m)), c, mode)
    want_loss, want_cf = value_ref(vp, v, R, m, c, mode)
    np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(cf), want_cf, rtol=RTOL, atol=ATOL)
    assert 0 < want_cf < 1


def test_value_loss_by_hand():
    # v_pred 2, v_old 1, R 3, c 0.5: clipped 1.5; (2-3)^2 = 1 < (1.5-3)^2 = 2.25 -> 0.5 * 2.25, clipped.
    # v_pred 1.2, v_old 1, R 0: inside the clip range; 0.5 * 1.44, not clipped.
    loss, cf = value_loss(jnp.array([[2.0, 1.2]]), jnp.array([[1.0, 1.0]]), jnp.array([[3.0, 0.0]]),
                          jnp.ones((1, 2)), 0.5)
    assert float(loss) == pytest.approx(0.5 * (2.25 + 1.44) / 2, rel=1e-6)
    assert float(cf) == pytest.approx(0.5)


def test_micro_batches_with_mini_batch_denominator_sum_to_the_whole():
    vp, v, R, m = (jnp.float32(x) for x in make(2))
    g = jax.jit(jax.grad(lambda p, v, R, m, den: value_loss(p, v, R, m, 0.3, "seq-mean-token-mean",
                                                            denominator=den)[0]))
    full = g(vp, v, R, m, None)
    den = loss_denominator(m, "seq-mean-token-mean")
    parts = [g(vp[a:b], v[a:b], R[a:b], m[a:b], den) for a, b in [(0, 3), (3, 4), (4, 8), (8, 10)]]
    np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in parts]), np.asarray(full), atol=1e-7)


def test_extreme_values_are_finite():
    vp, v, R, m = make(3)
    vp = vp * 1e6
    loss, cf = value_loss(*(jnp.float32(x) for x in (vp, v, R, m)))
    grad = jax.grad(lambda p: value_loss(p, jnp.float32(v), jnp.float32(R), jnp.float32(m))[0])(jnp.float32(vp))
    assert np.isfinite(float(loss)) and np.isfinite(float(cf)) and np.isfinite(np.asarray(grad)).all()
