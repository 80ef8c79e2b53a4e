"""The MoE experts' grouped products: the blocked layout (GPU, CPU) and ``jax.lax.ragged_dot`` (TPU) against a
float64 NumPy reference, forward and gradients, on fresh random inputs with empty groups, a group of one row and
groups longer than a block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.models import grouped_dot


def _reference(x, w, sizes):
    ends = np.cumsum(sizes)
    return np.concatenate([x[e - s:e] @ w[g] for g, (s, e) in enumerate(zip(sizes, ends))])


@pytest.mark.parametrize("how", grouped_dot.IMPLEMENTATIONS)
@pytest.mark.parametrize("sizes", [[0, 5, 1, 0, 40, 3, 0, 15], [64], [0, 0, 7]])
def test_grouped_product_and_its_gradients_match_float64(how, sizes):
    rng = np.random.default_rng(len(sizes) * 7 + sum(sizes))
    M, A, B = sum(sizes), 12, 10
    x, w = rng.normal(size=(M, A)), rng.normal(size=(len(sizes), A, B)) / np.sqrt(A)
    cot = rng.normal(size=(M, B))
    sizes_X = jnp.asarray(sizes, jnp.int32)

    def f(x, w):  # a small block, so that groups span several blocks and blocks are padded
        return grouped_dot.dot(grouped_dot.plan(sizes_X, M, how, block=4), x, w)

    y, vjp = jax.vjp(jax.jit(f), jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    np.testing.assert_allclose(y, _reference(x, w, sizes), rtol=1e-5, atol=1e-5)
    dx, dw = vjp(jnp.asarray(cot, jnp.float32))
    ends = np.cumsum(sizes)
    dx_ref = np.concatenate([cot[e - s:e] @ w[g].T for g, (s, e) in enumerate(zip(sizes, ends))])
    dw_ref = np.stack([x[e - s:e].T @ cot[e - s:e] for s, e in zip(sizes, ends)])
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)


def test_blocks_bound_the_padding():
    """At most rows / block + groups blocks, each of one group; the block shrinks where groups are small."""
    sizes = jnp.asarray([300, 0, 1, 211], jnp.int32)
    p = grouped_dot.plan(sizes, 512, "blocked")
    assert p.block == 128 and p.block_groups.shape == (4 + 4,)
    assert list(np.asarray(p.block_groups)) == [0, 0, 0, 2, 3, 3, 3, 3]  # 3 blocks of 300 rows, none for 0 rows
    assert grouped_dot.plan(jnp.asarray([3, 1, 0, 4], jnp.int32), 8, "blocked").block == 2
    assert grouped_dot.implementation("tpu") == "ragged"
    assert grouped_dot.implementation("gpu") == grouped_dot.implementation("cpu") == "blocked"
    # few rows (a decode step: 256 pairs over 128 experts of 2048 x 768): expanding them is smaller than the blocks'
    # gathered weights; many (a training pass: 32768 pairs) the other way round
    assert grouped_dot.implementation("gpu", rows=256, groups=128, width=(2048, 768)) == "ragged"
    assert grouped_dot.implementation("gpu", rows=32768, groups=128, width=(2048, 768)) == "blocked"
    with grouped_dot.using("ragged"):
        assert grouped_dot.implementation("gpu") == "ragged" and grouped_dot.plan(sizes, 512).block == 0
    with pytest.raises(ValueError, match="ragged"):
        grouped_dot.plan(sizes, 512, "dense")
