"""Loss aggregation modes, masked statistics and micro-batch invariance of gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos import LOSS_AGG_MODES, agg_loss, check_loss_agg_mode, loss_denominator, masked_whiten

from .algos_testdata import ATOL, RTOL, agg_ref, ragged_mask

B, T = 16, 10
SPLITS = [0, 2, 8, 11, 16]  # 4 micro-batches of 2, 6, 3, 5 rows (uneven token counts)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_modes_match_reference(mode, seed):
    rng = np.random.default_rng(seed)
    m = ragged_mask(rng, B, T, holes=seed == 1)
    L = rng.normal(size=(B, T))
    L[m == 0] = np.nan  # padding garbage must not leak
    got = jax.jit(agg_loss, static_argnums=2)(jnp.float32(L), jnp.float32(m), mode)
    np.testing.assert_allclose(float(got), agg_ref(L, m, mode), rtol=RTOL, atol=ATOL)
    if mode == "seq-mean-token-sum-norm":
        got = agg_loss(jnp.float32(L), jnp.float32(m), mode, norm_constant=4.0)
        np.testing.assert_allclose(float(got), agg_ref(L, m, mode, 4.0), rtol=RTOL, atol=ATOL)


def test_denominators():
    m = np.zeros((4, 5), np.float32)
    m[0, :3] = 1
    m[2, :] = 1
    m[3, :1] = 1
    assert float(loss_denominator(jnp.asarray(m), "token-mean")) == 9.0
    assert float(loss_denominator(jnp.asarray(m), "seq-mean-token-sum")) == 3.0
    assert float(loss_denominator(jnp.asarray(m), "seq-mean-token-mean")) == 3.0
    assert float(loss_denominator(jnp.asarray(m), "seq-mean-token-sum-norm")) == 5.0
    assert float(loss_denominator(jnp.asarray(m), "seq-mean-token-sum-norm", norm_constant=512)) == 512.0
    with pytest.raises(ValueError, match="loss_agg_mode.*token-mean"):
        check_loss_agg_mode("token_mean")


def _loss_fn(w, x, m, mode, den):
    """A nonlinear per-token loss of shared parameters w (T,), so gradients accumulate over micro-batches."""
    loss_mat = jnp.square(jnp.tanh(x * w[None, :]) - 0.3) * (1.0 + x)
    return agg_loss(loss_mat, m, mode, denominator=den)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_gradients_sum_to_mini_batch_gradient(mode):
    rng = np.random.default_rng(7)
    m = jnp.float32(ragged_mask(rng, B, T))
    x = jnp.float32(rng.normal(size=(B, T)))
    w = jnp.float32(rng.normal(size=T))
    grad = jax.jit(jax.value_and_grad(_loss_fn), static_argnums=3)
    full_loss, full_grad = grad(w, x, m, mode, None)
    den = loss_denominator(m, mode)  # computed once over the whole mini-batch
    acc_loss, acc_grad, naive_grad = 0.0, jnp.zeros_like(w), jnp.zeros_like(w)
    for a, b in zip(SPLITS[:-1], SPLITS[1:]):
        l_mb, g_mb = grad(w, x[a:b], m[a:b], mode, den)
        acc_loss, acc_grad = acc_loss + l_mb, acc_grad + g_mb
        # the PyTorch frameworks' accumulation: local normalisation, scaled by the micro-batch's share of rows
        _, g_naive = grad(w, x[a:b], m[a:b], mode, None)
        naive_grad = naive_grad + g_naive * (b - a) / B
    np.testing.assert_allclose(float(acc_loss), float(full_loss), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(acc_grad), np.asarray(full_grad), rtol=0, atol=1e-6)
    # naive per-micro-batch normalisation gives a different gradient, so the check above can fail
    assert np.abs(np.asarray(naive_grad) - np.asarray(full_grad)).max() > 1e-3


def test_masked_whiten_matches_reference_and_survives_tiny_masks():
    rng = np.random.default_rng(3)
    m = ragged_mask(rng, B, T, holes=True)
    x = rng.normal(size=(B, T)) * 3 + 1
    vals = x[m > 0]
    want = (x - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.asarray(masked_whiten(jnp.float32(x), jnp.float32(m)))[m > 0], want[m > 0],
                               rtol=RTOL, atol=ATOL)
    one = np.zeros((B, T), np.float32)
    one[3, 4] = 1.0
    for mask in (one, np.zeros((B, T), np.float32)):  # verl raises here; we stay finite
        assert np.isfinite(np.asarray(masked_whiten(jnp.float32(x), jnp.asarray(mask)))).all()
        for mode in LOSS_AGG_MODES:
            assert np.isfinite(float(agg_loss(jnp.float32(x), jnp.asarray(mask), mode)))
