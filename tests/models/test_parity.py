"""Logits parity with transformers (torch, float32) on tiny random checkpoints, left-padded batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rlhf_jax.models import from_pretrained
from rlhf_jax.models.config import UnsupportedModelError, from_hf_dict
from rlhf_jax.models.rope import static_inv_freq
from tests.conftest import TINY_DIMS, left_padded_batch

LENGTHS = [13, 9, 4, 13]
TINY_HEAD_DIM = TINY_DIMS["hidden_size"] // TINY_DIMS["num_attention_heads"]


def torch_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float().numpy()


@pytest.mark.parametrize("attn_impl", ["dense", "blockwise"])
@pytest.mark.parametrize("kind", ["llama", "llama_tied", "llama3_rope", "qwen2", "qwen3", "mistral", "mistral_window",
                                  "qwen2_window", "phi3", "gemma2",
                                  "gemma3_text"])
def test_causal_lm_logits_match_transformers(hf_checkpoint, kind, attn_impl):
    path, ref_model = hf_checkpoint(kind)
    rng = np.random.default_rng(1)
    ids, mask = left_padded_batch(rng, 128, LENGTHS)  # longer than the 8-token sliding windows
    expected = torch_logits(ref_model, ids, mask)

    model = from_pretrained(path, attn_impl=attn_impl)
    logits = jax.jit(lambda m, i, a: m(i, a))(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == (len(LENGTHS), max(LENGTHS), 128)
    real = mask.astype(bool)
    np.testing.assert_array_less(np.abs(np.asarray(logits) - expected)[real].max(), 1e-4)


def test_llama3_rope_scaling_is_applied(hf_checkpoint):
    path, _ = hf_checkpoint("llama3_rope")
    cfg = from_pretrained(path).config
    assert cfg.rope.rope_type == "llama3"
    default = static_inv_freq(cfg.head_dim, cfg.rope.__class__(theta=cfg.rope.theta))
    scaled = static_inv_freq(cfg.head_dim, cfg.rope)
    # Low frequencies are divided by the factor, high ones untouched.
    assert np.isclose(scaled[-1], default[-1] / 8.0) and np.isclose(scaled[0], default[0])


# Each RoPE scaling type with a context short enough (16 positions) that the 40-token rows go past it:
# dynamic NTK grows its base and longrope switches to its long factors only beyond it.
_HALF = TINY_HEAD_DIM // 2
ROPE_SCALINGS = {
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=3.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "yarn_mscale": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16, beta_fast=8.0, beta_slow=2.0,
                        mscale=0.8, mscale_all_dim=0.5, truncate=False),
    "longrope": dict(rope_type="longrope", original_max_position_embeddings=16,
                     short_factor=[1.0 + 0.1 * i for i in range(_HALF)], long_factor=[1.0 + 2.0 * i for i in range(_HALF)]),
}


@pytest.mark.parametrize("lengths", [LENGTHS, [40, 29, 7, 40]], ids=["short", "long"])
@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_rope_scaling_logits_match_transformers(hf_checkpoint, scaling, lengths):
    """Llama with each RoPE scaling type, within and beyond the 16-position context (float32, 1e-4)."""
    max_pos = 16 if scaling == "dynamic" else 64
    path, ref_model = hf_checkpoint("llama", rope_scaling=dict(ROPE_SCALINGS[scaling]), max_position_embeddings=max_pos)
    model = from_pretrained(path)
    assert model.config.rope.rope_type == ROPE_SCALINGS[scaling]["rope_type"]
    ids, mask = left_padded_batch(np.random.default_rng(6), 128, lengths)
    logits = jax.jit(lambda m, i, a: m(i, a))(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32))
    real = mask.astype(bool)
    np.testing.assert_array_less(np.abs(np.asarray(logits) - torch_logits(ref_model, ids, mask))[real].max(), 1e-4)


@pytest.mark.parametrize("lengths", [LENGTHS, [40, 29, 7, 40]], ids=["short", "long"])
def test_phi3_longrope_partial_rotary_logits_match_transformers(hf_checkpoint, lengths):
    """Phi-3 with longrope on half of each head and a 12-token window, within and beyond its 16-position context."""
    path, ref_model = hf_checkpoint("phi3_longrope")
    model = from_pretrained(path)
    assert model.config.rope.rope_type == "longrope" and model.config.sliding_window == 12
    ids, mask = left_padded_batch(np.random.default_rng(7), 128, lengths)
    logits = jax.jit(lambda m, i, a: m(i, a))(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32))
    real = mask.astype(bool)
    np.testing.assert_array_less(np.abs(np.asarray(logits) - torch_logits(ref_model, ids, mask))[real].max(), 1e-4)


def test_unsupported_rope_type_names_the_supported_ones():
    hf = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=2, rope_scaling=dict(rope_type="mrope", factor=2.0))
    with pytest.raises(UnsupportedModelError, match="mrope.*linear, dynamic, yarn, longrope, llama3"):
        from_hf_dict(hf)


def test_padding_does_not_change_real_positions(hf_checkpoint):
    """A left-padded row gives the same logits as the same row alone without padding."""
    path, _ = hf_checkpoint("qwen2")
    model = from_pretrained(path)
    rng = np.random.default_rng(2)
    ids, mask = left_padded_batch(rng, 128, [12, 5])
    batched = np.asarray(model(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))
    alone = np.asarray(model(jnp.asarray(ids[1:, -5:], jnp.int32)))
    np.testing.assert_allclose(batched[1, -5:], alone[0], atol=1e-5)


def packed_row(rng, lengths: list[int], total: int):
    """One row holding sequences of ``lengths`` back to back, then padding: (ids, segment ids, positions, pieces)."""
    ids = np.zeros(total, np.int64)
    seg = np.zeros(total, np.int32)
    pos = np.zeros(total, np.int32)
    pieces, start = [], 0
    for n, length in enumerate(lengths, start=1):
        piece = rng.integers(1, 128, length)
        ids[start : start + length], seg[start : start + length] = piece, n
        pos[start : start + length] = np.arange(length)
        pieces.append((start, piece))
        start += length
    return ids, seg, pos, pieces


@pytest.mark.parametrize("attn_impl", ["dense", "blockwise"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral_window"])
def test_packed_sequences_match_each_sequence_alone(hf_checkpoint, kind, attn_impl):
    """Rows of 3 and 2 packed sequences (segment ids, restarting positions, trailing padding) give each
    sequence's logits as transformers computes them for that sequence alone."""
    path, ref_model = hf_checkpoint(kind)
    rng = np.random.default_rng(4)
    rows = [packed_row(rng, [7, 11, 4], 26), packed_row(rng, [15, 6], 26)]
    ids, seg, pos = (np.stack([r[i] for r in rows]) for i in range(3))
    model = from_pretrained(path, attn_impl=attn_impl)
    run = jax.jit(lambda m, i, p, s: m(i, positions=p, segment_ids=s))
    logits = np.asarray(run(model, jnp.asarray(ids, jnp.int32), jnp.asarray(pos), jnp.asarray(seg)))
    for b, (_, _, _, pieces) in enumerate(rows):
        for start, piece in pieces:
            expected = torch_logits(ref_model, piece[None], np.ones((1, len(piece)), np.int64))[0]
            np.testing.assert_array_less(np.abs(logits[b, start : start + len(piece)] - expected).max(), 1e-4)
    # Positions default to restarting at each segment; the padding mask defaults to segment_ids > 0.
    default = np.asarray(jax.jit(lambda m, i, s: m(i, segment_ids=s))(model, jnp.asarray(ids, jnp.int32), jnp.asarray(seg)))
    np.testing.assert_allclose(default[seg > 0], logits[seg > 0], atol=1e-6)


def test_packed_token_values_match_each_sequence_alone(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    critic = from_pretrained(path, task="token_value")
    ids, seg, pos, pieces = packed_row(np.random.default_rng(5), [9, 5, 8], 24)
    packed = jax.jit(lambda m, i, p, s: m(i, positions=p, segment_ids=s))(
        critic, jnp.asarray(ids[None], jnp.int32), jnp.asarray(pos[None]), jnp.asarray(seg[None]))
    # Each sequence alone: one left-padded row per sequence.
    width = max(len(piece) for _, piece in pieces)
    alone_ids = np.stack([np.pad(piece, (width - len(piece), 0)) for _, piece in pieces])
    alone_mask = np.stack([np.arange(width) >= width - len(piece) for _, piece in pieces]).astype(np.int32)
    alone = np.asarray(jax.jit(lambda m, i, a: m(i, a))(critic, jnp.asarray(alone_ids, jnp.int32), jnp.asarray(alone_mask)))
    for row, (start, piece) in enumerate(pieces):
        np.testing.assert_allclose(np.asarray(packed)[0, start : start + len(piece)], alone[row, width - len(piece) :], atol=1e-5)
