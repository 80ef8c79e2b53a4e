"""place_on_last_token and the DAPO overlong penalty against float64 NumPy references."""

import jax
import numpy as np
import pytest

from rlhf_jax.rewards.shaping import overlong_penalty, place_on_last_token


def _place_reference(score, mask):
    out = np.zeros(mask.shape, dtype=np.float64)
    for b in range(mask.shape[0]):
        valid = np.nonzero(mask[b])[0]
        if valid.size:
            out[b, valid[-1]] = score[b]
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_place_on_last_token(seed):
    rng = np.random.default_rng(seed)
    B, T = 9, 13
    lengths = rng.integers(0, T + 1, size=B)
    lengths[0], lengths[1] = T, 0  # a full row and an empty row
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
    mask[2] = rng.integers(0, 2, size=T)  # a non-contiguous mask: the last 1 still wins
    mask[2, -1] = 0
    score = rng.normal(size=B)
    got = jax.jit(place_on_last_token)(score.astype(np.float32), mask)
    assert got.shape == (B, T) and got.dtype == np.float32
    np.testing.assert_allclose(np.asarray(got, np.float64), _place_reference(score, mask), rtol=1e-6, atol=1e-7)
    assert np.asarray(got)[1].sum() == 0.0


def test_overlong_penalty():
    rng = np.random.default_rng(3)
    L_max, L_buf, factor = 64, 16, rng.uniform(0.5, 2.0)
    lengths = rng.integers(0, L_max + 1, size=50)
    ref = np.minimum(-(lengths.astype(np.float64) - (L_max - L_buf)) / L_buf * factor, 0.0)
    got = np.asarray(overlong_penalty(lengths, L_max, L_buf, factor), np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert got[lengths <= L_max - L_buf].max() == 0.0
    np.testing.assert_allclose(overlong_penalty(np.array([L_max]), L_max, L_buf, factor), [-factor], rtol=1e-6)
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        overlong_penalty(lengths, L_max, 0, factor)
