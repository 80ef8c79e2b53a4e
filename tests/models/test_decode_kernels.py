"""The Pallas decode kernels (TPU and GPU, in interpret mode on CPU) against the dense decode path.

Cache shapes are tiny (interpret mode runs the kernel's grid step by step) but cover: ragged fills of
prompt and response, holes in a prompt's mask, grouped-query heads, sliding windows (counted in valid
keys), a last block that reaches past the cache, and refilled slots whose stale columns past their
fill hold old values (finite) or NaN (in blocks the kernel must not read).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.models import decode_kernels
from rlhf_jax.models.attention import attention, select_decode_implementation
from rlhf_jax.models.decode_attention import attention_weights_mask, decode_attention, dense_decode_attention
from rlhf_jax.models.kernel_layout import kernel_layout
from rlhf_jax.parallel.mesh import single_device_mesh

KERNELS = {"pallas_tpu": 128, "pallas_gpu": 32}  # implementation: block of cache columns (several blocks per row)


def fresh_rng():
    """A generator on a new seed each run, and the seed (printed by a failing assertion to replay it)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def slot_cache(rng, *, B=5, K=2, G=3, D=16, P=24, S=301, dtype=jnp.float32):
    """A decode step's inputs as the sampler lays them out: prompts left-padded in [0, P), response t at P + t,
    the query's token staged in the last column. Row 0 is a refilled slot: a short new sample over the long
    response its previous sample left behind. Row 1 has a hole in its prompt, row 2 an empty prompt."""
    q = rng.normal(size=(B, K * G, D))
    k = rng.normal(size=(B, K, D, S))
    v = rng.normal(size=(B, K, S, D))
    valid = np.zeros((B, S), bool)
    for b in range(B):
        plen = [P, int(rng.integers(3, P)), 0][b] if b < 3 else int(rng.integers(1, P + 1))
        fill = [2, int(rng.integers(0, S - P - 1)), 5][b] if b < 3 else int(rng.integers(0, S - P - 1))
        valid[b, P - plen:P] = True
        valid[b, P:P + fill] = True
    valid[1, P - 2] = False
    valid[:, S - 1] = True
    cast = lambda x: jnp.asarray(x, jnp.float32).astype(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(valid), jnp.full((B,), S - 1, jnp.int32)


def run_kernel(name, q, k, v, valid, q_slot, window, *, scale, softcap=None):
    B, H, D = q.shape
    K = k.shape[1]
    visible = attention_weights_mask(q_slot[:, None], valid, window)[:, 0]
    fn = decode_kernels.tpu_decode_attention if name == "pallas_tpu" else decode_kernels.gpu_decode_attention
    out = fn(q.reshape(B, K, H // K, D), k, v, visible, q_slot, scale=scale, softcap=softcap, block=KERNELS[name],
             interpret=True)
    return out.reshape(B, H, D)


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("window", [None, 1, 9, 150])
def test_kernel_matches_dense_fp32(name, window):
    rng, seed = fresh_rng()
    q, k, v, valid, q_slot = slot_cache(rng)
    softcap = 3.0 if window == 9 else None
    ref = dense_decode_attention(q, k, v, q_slot, valid, jnp.float32, window, 0.3, softcap)
    out = run_kernel(name, q, k, v, valid, q_slot, window, scale=0.3, softcap=softcap)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0, err_msg=f"seed {seed}")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_matches_dense_bf16(name):
    rng, seed = fresh_rng()
    q, k, v, valid, q_slot = slot_cache(rng, dtype=jnp.bfloat16)
    ref = dense_decode_attention(q, k, v, q_slot, valid, jnp.bfloat16, 9, None, None)
    exact = dense_decode_attention(*(x.astype(jnp.float32) for x in (q, k, v)), q_slot, valid, jnp.float32, 9)
    out = run_kernel(name, q, k, v, valid, q_slot, 9, scale=16**-0.5)
    assert out.dtype == jnp.bfloat16
    # Both round the probabilities and the output to bf16 (8 bits of mantissa), in different orders:
    # each is within 2e-2 of the float32 result on outputs of size about 1.
    for got in (out, ref):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(exact), atol=2e-2, rtol=0, err_msg=f"seed {seed}")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_reads_only_the_visited_blocks(name):
    """NaN in every block a row does not need leaves its output finite and equal to the clean cache's."""
    rng, seed = fresh_rng()
    q, k, v, valid, q_slot = slot_cache(rng)
    block = KERNELS[name]
    ref = dense_decode_attention(q, k, v, q_slot, valid, jnp.float32, None, 0.25)
    lo_blk, main, q_blk, visits = (np.asarray(x) for x in decode_kernels.block_plan(valid, q_slot, block))
    needed = np.zeros(valid.shape, bool)
    for b in range(valid.shape[0]):
        for j in range(visits[b]):
            blk = lo_blk[b] + j if j < main[b] else q_blk[b]
            needed[b, blk * block:(blk + 1) * block] = True
    assert (~needed[0]).sum() >= block and (~needed[2]).sum() >= block  # short fills skip blocks
    assert not np.any(np.asarray(valid) & ~needed)
    poison = jnp.asarray(~needed)
    k_bad = jnp.where(poison[:, None, None, :], jnp.nan, k)
    v_bad = jnp.where(poison[:, None, :, None], jnp.nan, v)
    out = run_kernel(name, q, k_bad, v_bad, valid, q_slot, None, scale=0.25)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0, err_msg=f"seed {seed}")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_when_the_cache_is_one_block_and_heads_are_not_grouped(name):
    rng, seed = fresh_rng()
    q, k, v, valid, q_slot = slot_cache(rng, B=3, K=4, G=1, D=32, P=8, S=20)
    ref = dense_decode_attention(q, k, v, q_slot, valid, jnp.float32, 4)
    out = decode_attention(q, k, v, q_slot, valid, jnp.float32, 4, implementation=name, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0, err_msg=f"seed {seed}")


def test_decode_selection_by_platform():
    assert select_decode_implementation("auto", "cpu", 64)[0] == "dense"
    assert select_decode_implementation("auto", "tpu", 80)[0] == "pallas_tpu"
    assert select_decode_implementation("auto", "gpu", 128)[0] == "pallas_gpu"
    gpu_odd = select_decode_implementation("auto", "gpu", 80)
    assert gpu_odd[0] == "dense" and "power-of-two" in gpu_odd[1]
    assert select_decode_implementation("pallas_tpu", "cpu", 64)[0] == "dense"  # cannot compile here
    assert select_decode_implementation("pallas_tpu", "cpu", 64, interpret=True)[0] == "pallas_tpu"
    assert select_decode_implementation("dense", "tpu", 64)[0] == "dense"
    with pytest.raises(ValueError, match="unknown decode attention implementation 'paged'"):
        select_decode_implementation("paged", "tpu", 64)


def optimized_hlo(fn, *args) -> list[str]:
    """The instructions of ``jit(fn)``'s compiled HLO as (shape, opcode) in order: the program without its names."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return re.findall(r"= (\S+) ([\w-]+)\(", text[text.index("HloModule"):])


def test_cpu_default_is_the_dense_path():
    """On CPU the default decode step compiles to exactly the dense function's program (the platform switch that
    picks a kernel on TPU and GPU is resolved when lowering)."""
    rng, seed = fresh_rng()
    q, k, v, valid, q_slot = slot_cache(rng, B=2, S=40, P=8)

    def auto(*a):
        with kernel_layout(single_device_mesh()):  # where the sampler's step may run a kernel
            return decode_attention(*a, jnp.float32, 5)

    auto = optimized_hlo(auto, q, k, v, q_slot, valid)
    dense = optimized_hlo(lambda *a: dense_decode_attention(*a, jnp.float32, 5), q, k, v, q_slot, valid)
    assert auto == dense


def test_cpu_training_attention_is_unchanged_inside_a_kernel_layout():
    """Inside a layout, attention's program switches by platform; on CPU it compiles to the XLA path's program,
    forward and backward (no residuals of the kernel branches survive)."""
    rng, seed = fresh_rng()
    q, k, v = (jnp.asarray(rng.normal(size=(2, 256, h, 16)), jnp.float32) for h in (4, 2, 2))

    def grads(q, k, v):
        return jax.grad(lambda *a: jnp.sum(attention(*a, sliding_window=100) ** 2), argnums=(0, 1, 2))(q, k, v)

    def in_layout(q, k, v):
        with kernel_layout(single_device_mesh()):
            return grads(q, k, v)

    program = optimized_hlo(grads, q, k, v)
    assert len(program) > 50 and optimized_hlo(in_layout, q, k, v) == program
