"""The attention entry point: every implementation against a float64 NumPy reference, outputs and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.models import attention_kernels
from rlhf_jax.models.attention import DENSE_MAX_PAIRS, CallShape, attention, select_implementation

H, K, D = 4, 2, 8
SCALE = D**-0.5


def reference_mask(slots, valid, q_seg, kv_seg, window):
    """(B, T, S) visibility written from the rule: valid, j <= slot, same non-zero segment, in the window."""
    j = np.arange(valid.shape[1])[None, None, :]
    i = slots[:, :, None]
    # Packed units: a unit's prompt has branch 0, its responses branches 1, 2, ... (segment = unit << 12 | branch);
    # plain segments are units of their own (ids below 4096). A query sees its own segment and its unit's prompt.
    q_unit, q_branch = np.divmod(q_seg[:, :, None], 4096)
    kv_unit, kv_branch = np.divmod(kv_seg[:, None, :], 4096)
    same_segment = q_seg[:, :, None] == kv_seg[:, None, :]
    own_prompt = (q_unit == kv_unit) & (q_unit > 0) & (kv_branch == 0)
    mask = valid[:, None, :] & (j <= i) & (same_segment | own_prompt) & (q_seg[:, :, None] != 0)
    if window is not None:
        mask &= i - j < window
    return mask


def reference(q, k, v, mask, d_out, softcap=None):
    """float64 masked softmax attention with grouped heads, scores soft-capped when ``softcap`` is given:
    output and (dq, dk, dv) for cotangent ``d_out``."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    B, S, Kh, Dh = k.shape
    G = q.shape[2] // Kh
    kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    m4 = mask[:, None]
    raw = np.einsum("bthd,bshd->bhts", q, kr) * SCALE
    capped = raw if softcap is None else softcap * np.tanh(raw / softcap)
    s = np.where(m4, capped, -np.inf)
    top = s.max(-1, keepdims=True)
    e = np.where(m4, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)
    out = np.einsum("bhts,bshd->bthd", p, vr)
    dp = np.einsum("bthd,bshd->bhts", d_out, vr)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    if softcap is not None:
        ds = ds * (1 - np.tanh(raw / softcap) ** 2)
    dq = np.einsum("bhts,bshd->bthd", ds, kr) * SCALE
    dk = (np.einsum("bhts,bthd->bshd", ds, q) * SCALE).reshape(B, S, Kh, G, Dh).sum(3)
    dv = np.einsum("bhts,bthd->bshd", p, d_out).reshape(B, S, Kh, G, Dh).sum(3)
    return out, (dq, dk, dv)


def random_qkv(rng, B, T, S):
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k = rng.standard_normal((B, S, K, D)).astype(np.float32)
    v = rng.standard_normal((B, S, K, D)).astype(np.float32)
    return q, k, v


def case(name, rng):
    """(T, S, q_slots or None, key_valid, q_seg or None, kv_seg or None, window) for a named situation."""
    B, T = 3, 45
    valid = np.ones((B, T), bool)
    if name == "left_padding":
        valid[0, :11], valid[1, :30] = False, False  # rows 0 and 1 have fully masked padding queries
        return T, T, None, valid, None, None, None
    if name == "left_and_right_padding_window":
        valid[0, :7], valid[1, 40:], valid[2, :20] = False, False, False
        valid[2, 40:] = False
        return T, T, None, valid, None, None, 9
    if name == "packed_segments":
        seg = np.zeros((B, T), np.int32)
        seg[0, :20], seg[0, 20:33], seg[0, 33:41] = 1, 2, 3  # trailing padding 41..44
        seg[1, :] = 1
        seg[2, 5:17], seg[2, 17:44] = 1, 2  # padding on both ends
        return T, T, None, seg > 0, seg, seg, None
    if name == "packed_segments_window":
        seg = np.repeat(np.arange(1, 6), 9)[None].repeat(B, 0).astype(np.int32)
        seg[1, 30:] = 0
        return T, T, None, seg > 0, seg, seg, 4
    if name == "shared_prompts":
        # Row 0: a 10-token prompt with responses of 8, 5 and 12 tokens, then a plain segment; row 1: two units.
        seg = np.zeros((B, T), np.int32)
        seg[0, :10], seg[0, 10:18], seg[0, 18:23], seg[0, 23:35], seg[0, 35:42] = 4096, 4097, 4098, 4099, 3
        seg[1, :6], seg[1, 6:20], seg[1, 20:30], seg[1, 30:38], seg[1, 38:45] = 4096, 4097, 8192, 8193, 8194
        seg[2, 2:40] = 1
        return T, T, None, seg > 0, seg, seg, None
    if name == "prefill_into_cache":
        # 20 new queries at slots 17..36 of a 52-slot cache whose first rows hold left-padded prompts.
        S = 52
        valid = np.zeros((B, S), bool)
        valid[0, 3:37], valid[1, 12:37], valid[2, 30:37] = True, True, True
        slots = np.broadcast_to(17 + np.arange(20), (B, 20)).copy()
        return 20, S, slots, valid, None, None, None
    raise ValueError(name)


CASES = ["left_padding", "left_and_right_padding_window", "packed_segments", "packed_segments_window", "shared_prompts",
         "prefill_into_cache"]


def run(impl, q, k, v, d_out, T, slots, valid, q_seg, kv_seg, window, **kw):
    def f(q, k, v):
        return attention(q, k, v, q_slots_BT=None if slots is None else jnp.asarray(slots), key_valid_BS=jnp.asarray(valid),
                         q_segment_ids_BT=None if q_seg is None else jnp.asarray(q_seg),
                         kv_segment_ids_BS=None if kv_seg is None else jnp.asarray(kv_seg),
                         sliding_window=window, implementation=impl, **kw)

    out, vjp = jax.vjp(f, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    return np.asarray(out), [np.asarray(g) for g in vjp(jnp.asarray(d_out))]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("impl,kw", [("dense", {}), ("blockwise", {"block_size": 16}), ("blockwise", {})])
def test_matches_float64_reference(name, impl, kw):
    """Outputs within 1e-5 and gradients within 2e-5 (float32 vs float64); rows that see nothing give zeros."""
    rng = np.random.default_rng(CASES.index(name))
    T, S, slots, valid, q_seg, kv_seg, window = case(name, rng)
    q, k, v = random_qkv(rng, valid.shape[0], T, S)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    ref_slots = np.broadcast_to(np.arange(T), (valid.shape[0], T)) if slots is None else slots
    ones_q, ones_kv = np.ones(ref_slots.shape, np.int32), np.ones(valid.shape, np.int32)
    mask = reference_mask(ref_slots, valid, ones_q if q_seg is None else q_seg, ones_kv if kv_seg is None else kv_seg, window)
    ref_out, ref_grads = reference(q, k, v, mask, d_out)

    out, grads = run(impl, q, k, v, d_out, T, slots, valid, q_seg, kv_seg, window, **kw)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    assert (out[~mask.any(-1)] == 0).all()
    for got, want in zip(grads, ref_grads):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl,kw", [("dense", {}), ("blockwise", {"block_size": 16})])
@pytest.mark.parametrize("name", ["left_and_right_padding_window", "packed_segments"])
def test_soft_capped_scores_match_float64_reference(name, impl, kw):
    """Gemma 2's capped scores (cap 2, well inside the range of these scores, so the cap changes them)."""
    rng = np.random.default_rng(10 + CASES.index(name))
    T, S, slots, valid, q_seg, kv_seg, window = case(name, rng)
    q, k, v = random_qkv(rng, valid.shape[0], T, S)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    ref_slots = np.broadcast_to(np.arange(T), (valid.shape[0], T))
    ones = np.ones(valid.shape, np.int32)
    mask = reference_mask(ref_slots, valid, ones if q_seg is None else q_seg, ones if kv_seg is None else kv_seg, window)
    ref_out, ref_grads = reference(q, k, v, mask, d_out, softcap=2.0)
    assert np.abs(ref_out - reference(q, k, v, mask, d_out)[0]).max() > 0.1
    out, grads = run(impl, q, k, v, d_out, T, slots, valid, q_seg, kv_seg, window, softcap=2.0, **kw)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_fully_masked_rows_are_zero_with_finite_gradients():
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 2, 24, 24)
    valid = np.zeros((2, 24), bool)
    valid[0, 10:] = True  # row 1 is all padding
    for impl in ("dense", "blockwise"):
        out, grads = run(impl, q, k, v, np.ones_like(q), 24, None, valid, None, None, None, block_size=8)
        assert (out[0, :10] == 0).all() and (out[1] == 0).all()
        assert all(np.isfinite(g).all() for g in grads)
        assert (grads[1][1] == 0).all()  # no key of the padding row receives gradient


def call_shape(T=512, S=512, D=64, dtype="bfloat16", self_attention=True, segments=False):
    return CallShape(T, S, D, dtype, self_attention, segments)


def test_select_implementation():
    small, large = call_shape(T=64, S=64), call_shape()
    assert 64 * 64 <= DENSE_MAX_PAIRS < 512 * 512
    assert select_implementation("auto", "cpu", small)[0] == "dense"
    assert select_implementation("auto", "cpu", large)[0] == "blockwise"
    assert select_implementation("auto", "gpu", large)[0] == "cudnn"
    assert select_implementation("auto", "gpu", call_shape(dtype="float32"))[0] == "blockwise"
    assert select_implementation("auto", "gpu", call_shape(segments=True))[0] == "blockwise"
    assert select_implementation("auto", "gpu", call_shape(self_attention=False))[0] == "blockwise"
    assert select_implementation("auto", "gpu", call_shape(D=256))[0] == "blockwise"
    assert select_implementation("auto", "tpu", large)[0] == "splash"
    # Packed rows let a response see its shared prompt: splash's equality-only segment mask cannot say that.
    assert select_implementation("auto", "tpu", call_shape(segments=True))[0] == "blockwise"
    assert select_implementation("auto", "tpu", call_shape(T=500, S=500))[0] == "blockwise"
    assert select_implementation("auto", "tpu", large, splash_available=False)[0] == "blockwise"
    assert select_implementation("auto", "tpu", call_shape(T=64, S=64))[0] == "dense"
    # Explicit kernels fall back where they cannot run; explicit XLA paths are always honoured.
    assert select_implementation("cudnn", "cpu", large)[0] == "blockwise"
    assert select_implementation("splash", "gpu", small)[0] == "dense"
    assert select_implementation("dense", "gpu", large)[0] == "dense"
    assert select_implementation("blockwise", "tpu", small)[0] == "blockwise"
    with pytest.raises(ValueError, match="unknown attention implementation"):
        select_implementation("flash", "cpu", small)


def test_requested_kernel_on_cpu_runs_the_xla_path():
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 2, 16, 16)
    dense, _ = run("dense", q, k, v, q, 16, None, np.ones((2, 16), bool), None, None, None)
    for impl in ("cudnn", "splash"):
        np.testing.assert_allclose(run(impl, q, k, v, q, 16, None, np.ones((2, 16), bool), None, None, None)[0], dense, atol=1e-6)


def test_argument_errors():
    q, k, v = (jnp.zeros((1, 8, H, D)), jnp.zeros((1, 6, K, D)), jnp.zeros((1, 6, K, D)))
    with pytest.raises(ValueError, match="self-attention"):
        attention(q, k, v)
    seg = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="both"):
        attention(q, q[:, :, :K], q[:, :, :K], q_segment_ids_BT=seg)
    with pytest.raises(ValueError, match="sliding_window"):
        attention(q, q[:, :, :K], q[:, :, :K], sliding_window=0)


def kernel_case(T):
    """Self-attention rows for the fused kernels: left padding, right padding, both, and (row 3) a hole."""
    valid = np.ones((4, T), bool)
    valid[0, :T // 3] = False
    valid[1, T - 5:] = False
    valid[2, :4], valid[2, T - 9:] = False, False
    valid[3, 10:14] = False
    return valid


@pytest.mark.parametrize("window", [None, 7])
def test_cudnn_wrapper_layout_through_the_xla_kernel(window):
    """The cuDNN wrapper (padding rolled to the end, seq lengths, window) run with jax's XLA kernel: real queries
    exact, padding queries zero; a row with a hole in its padding takes the blockwise path."""
    rng = np.random.default_rng(2)
    T = 40
    valid = kernel_case(T)
    q, k, v = random_qkv(rng, 4, T, T)
    d_out = rng.standard_normal(q.shape).astype(np.float32) * valid[:, :, None, None]
    slots = np.broadcast_to(np.arange(T), (4, T))
    ones = np.ones((4, T), np.int32)
    mask = reference_mask(slots, valid, ones, ones, window)
    for rows in (slice(0, 3), slice(0, 4)):  # without and with the row that needs the fallback
        ref_out, ref_grads = reference(q[rows], k[rows], v[rows], mask[rows], d_out[rows])

        def f(q_, k_, v_):
            return attention_kernels.cudnn_self_attention(q_, k_, v_, jnp.asarray(valid[rows]), window=window,
                                                          scale=SCALE, implementation="xla")

        out, vjp = jax.vjp(f, *(jnp.asarray(x[rows]) for x in (q, k, v)))
        real = valid[rows]
        np.testing.assert_allclose(np.asarray(out)[real], ref_out[real], atol=1e-5)
        assert (np.asarray(out)[~real] == 0).all()
        for got, want in zip(vjp(jnp.asarray(d_out[rows])), ref_grads):
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


@pytest.mark.parametrize("segments,window", [(False, None), (True, 5)])
def test_splash_wrapper_in_interpret_mode(segments, window):
    """The splash wrapper (segment 0 for padding, one MQA kernel per kv head) with Pallas in interpret mode on CPU."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    rng = np.random.default_rng(3)
    T = 128
    valid = kernel_case(T)
    seg = np.where(valid, 1, 0).astype(np.int32)
    if segments:
        seg[:, 60:] = np.where(valid[:, 60:], 2, 0)
    q, k, v = random_qkv(rng, 4, T, T)
    d_out = rng.standard_normal(q.shape).astype(np.float32) * valid[:, :, None, None]
    mask = reference_mask(np.broadcast_to(np.arange(T), (4, T)), valid, seg, seg, window)
    ref_out, ref_grads = reference(q, k, v, mask, d_out)

    def f(q_, k_, v_):
        return attention_kernels.splash_self_attention(q_, k_, v_, jnp.asarray(valid), jnp.asarray(seg) if segments else None,
                                                       window=window, scale=SCALE, interpret=True)

    out, vjp = jax.vjp(f, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    np.testing.assert_allclose(np.asarray(out)[valid], ref_out[valid], atol=1e-5)
    assert (np.asarray(out)[~valid] == 0).all()
    for got, want in zip(vjp(jnp.asarray(d_out)), ref_grads):
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def compiled_temp_bytes(T: int, impl: str) -> int:
    """Temporary memory XLA plans for forward + backward of projections -> attention at sequence length T."""
    E = 32

    def loss(w, x):
        q, k, v = (jnp.einsum("bte,ehd->bthd", x, wi) for wi in w)
        return jnp.sum(attention(q, k, v, key_valid_BS=jnp.ones(x.shape[:2], bool), implementation=impl) ** 2)

    w = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in [(E, H, D), (E, K, D), (E, K, D)])
    x = jax.ShapeDtypeStruct((1, T, E), jnp.float32)
    return jax.jit(jax.grad(loss)).lower(w, x).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_dense_quadratically():
    blockwise = compiled_temp_bytes(4096, "blockwise") / compiled_temp_bytes(1024, "blockwise")
    dense = compiled_temp_bytes(4096, "dense") / compiled_temp_bytes(1024, "dense")
    print(f"temp memory 4096 / 1024 tokens: blockwise {blockwise:.1f}x, dense {dense:.1f}x")
    assert blockwise < 4
    assert dense > 12  # 16x for the (T, S) scores
