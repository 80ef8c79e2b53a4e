"""Chunked entropy / token log-probs vs an unchunked float64 reference; gradients; memory of the chunked scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos import entropy_from_logits, map_sequence_chunks, token_log_probs, token_log_probs_and_entropy

B, T, V = 3, 11, 37


def log_softmax_ref(z):
    out = np.zeros_like(z)
    for idx in np.ndindex(z.shape[:-1]):
        row = z[idx]
        mx = row.max()
        out[idx] = row - (mx + np.log(np.sum(np.exp(row - mx))))
    return out


def entropy_ref(z, temp):
    lp = log_softmax_ref(z / temp)
    return -np.sum(np.exp(lp) * lp, axis=-1)


def logprob_ref(z, ids, temp):
    lp = log_softmax_ref(z / temp)
    return np.take_along_axis(lp, ids[..., None], axis=-1)[..., 0]


def make(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, T, V)) * 3.0, rng.integers(0, V, size=(B, T))


@pytest.mark.parametrize("chunk,temp", [(1, 1.0), (4, 0.6), (T, 1.0), (None, 0.6)])
def test_chunked_matches_float64_reference(chunk, temp):
    z, ids = make(0)
    f = jax.jit(lambda z, i: token_log_probs_and_entropy(z, i, temperature=temp, chunk_size=chunk))
    lp, ent = f(jnp.float32(z), jnp.int32(ids))
    np.testing.assert_allclose(np.asarray(lp), logprob_ref(z, ids, temp), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), entropy_ref(z, temp), rtol=1e-5, atol=1e-5)
    e2 = jax.jit(lambda z: entropy_from_logits(z, temperature=temp, chunk_size=chunk))(jnp.float32(z))
    l2 = jax.jit(lambda z, i: token_log_probs(z, i, temperature=temp, chunk_size=chunk))(jnp.float32(z),
                                                                                        jnp.int32(ids))
    np.testing.assert_allclose(np.asarray(e2), np.asarray(ent), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(l2), np.asarray(lp), rtol=1e-6, atol=1e-6)


def test_bfloat16_logits_are_scored_in_float32():
    z, ids = make(1)
    zb = jnp.asarray(z, jnp.bfloat16)
    zr = np.asarray(zb.astype(jnp.float32), np.float64)  # the exact bf16 values, in float64
    lp = token_log_probs(zb, jnp.int32(ids), chunk_size=4)
    assert lp.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lp), logprob_ref(zr, ids, 1.0), rtol=1e-5, atol=1e-5)


def test_gradients_match_analytic_and_unchunked():
    z, ids = make(2)
    w = np.random.default_rng(2).normal(size=(B, T))
    temp = 0.8

    def obj(z, chunk):
        lp, ent = token_log_probs_and_entropy(z, jnp.int32(ids), temperature=temp, chunk_size=chunk)
        return jnp.sum(lp * w) + 0.3 * jnp.sum(ent)

    g_chunk = np.asarray(jax.jit(jax.grad(obj), static_argnums=1)(jnp.float32(z), 3))
    g_full = np.asarray(jax.jit(jax.grad(obj), static_argnums=1)(jnp.float32(z), T))
    # analytic float64: d logp_id / dz = (onehot - p) / temp;  dH/dz = -p (log p + H) / temp
    lpv = log_softmax_ref(z / temp)
    p = np.exp(lpv)
    h = -np.sum(p * lpv, axis=-1, keepdims=True)
    onehot = np.eye(V)[ids]
    want = (w[..., None] * (onehot - p) + 0.3 * (-p * (lpv + h))) / temp
    np.testing.assert_allclose(g_chunk, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g_chunk, g_full, rtol=1e-5, atol=1e-6)


def test_map_sequence_chunks_reassembles_positions_exactly():
    x = jnp.arange(2 * 10, dtype=jnp.float32).reshape(2, 10)[..., None]
    out = map_sequence_chunks(lambda c: c[..., 0] * 2.0, x, chunk_size=4)  # chunks at 0, 4 and 6 (overlapping)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x[..., 0] * 2.0))
    with pytest.raises(ValueError, match="chunk_size"):
        map_sequence_chunks(lambda c: c[..., 0], x, chunk_size=0)


def test_chunking_bounds_temporary_memory():
    """The compiled chunked backward never holds a whole (batch, length, vocab) float32 temporary."""
    b, t, v = 2, 128, 2048
    full_bytes = b * t * v * 4
    x = jax.ShapeDtypeStruct((b, t, v), jnp.float32)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def temp_bytes(fn, *args):
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    for chunk in (4, 8):
        bound = 4 * b * chunk * v * 4  # a few float32 chunk blocks, far below one whole tensor
        assert bound <= full_bytes / 4
        assert temp_bytes(lambda z: entropy_from_logits(z, chunk_size=chunk), x) <= bound
        assert temp_bytes(jax.grad(lambda z: jnp.sum(entropy_from_logits(z, chunk_size=chunk))), x) <= bound
        assert temp_bytes(jax.grad(lambda z, i: jnp.sum(token_log_probs(z, i, chunk_size=chunk))), x, ids) <= bound
    # unchunked, the entropy backward does keep whole-vocabulary temporaries (so the check above can fail)
    assert temp_bytes(jax.grad(lambda z: jnp.sum(entropy_from_logits(z, chunk_size=t))), x) >= full_bytes
