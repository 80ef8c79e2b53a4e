"""Fused attention kernels for self-attention: cuDNN (GPU) and Pallas splash attention (TPU).

Both have a static causal mask, so they serve only self-attention (query i at slot
i, T == S); ``attention.attention`` decides when. Queries that are padding get
zeros here. Each wrapper takes the kernel as a parameter (``implementation`` of
``jax.nn.dot_product_attention``, ``interpret`` for Pallas) so that its layout
work (rolling left padding away, segment ids, grouped heads) runs on CPU too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhf_jax.models.blockwise import DEFAULT_BLOCK, blockwise_attention

SPLASH_BLOCKS = (512, 256, 128)  # the kernel's blocks must divide the sequence and be multiples of 128


def splash_block(seq_len: int) -> int | None:
    """The largest splash block length that divides ``seq_len``, or None when none does."""
    return next((b for b in SPLASH_BLOCKS if seq_len % b == 0), None)


def _roll_rows(x_BT, shift_B):
    """Row b shifted left by ``shift_B[b]`` (cyclically) along axis 1."""
    T = x_BT.shape[1]
    idx = (jnp.arange(T)[None, :] + shift_B[:, None]) % T
    idx = idx.reshape(idx.shape + (1,) * (x_BT.ndim - 2))
    return jnp.take_along_axis(x_BT, idx, axis=1)


def _padded_kernel_attention(q, k, v, key_valid, *, window, scale, implementation):
    """cuDNN's padding mask expects each row's tokens first: roll left padding to the end, attend, roll back.

    A uniform shift within a row keeps slot differences, so causality and the window are unchanged.
    """
    T = q.shape[1]
    first = jnp.argmax(key_valid, axis=1).astype(jnp.int32)
    count = jnp.sum(key_valid, axis=1).astype(jnp.int32)
    lengths = jnp.maximum(count, 1)  # an all-padding row still needs one key; its output is zeroed below
    out = jax.nn.dot_product_attention(
        _roll_rows(q, first), _roll_rows(k, first), _roll_rows(v, first), scale=scale, is_causal=True,
        query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        local_window_size=None if window is None else (window - 1, 0), implementation=implementation,
    )
    out = jnp.where((jnp.arange(T)[None, :] < count[:, None])[:, :, None, None], out, 0)
    return _roll_rows(out, (T - first) % T)


def _is_one_span(key_valid_BS) -> jax.Array:
    """True when every row's valid keys form one contiguous run (left and/or right padding only)."""
    S = key_valid_BS.shape[1]
    first = jnp.argmax(key_valid_BS, axis=1)[:, None]
    count = jnp.sum(key_valid_BS, axis=1)[:, None]
    slots = jnp.arange(S)[None, :]
    return jnp.all(key_valid_BS == ((slots >= first) & (slots < first + count)))


def cudnn_self_attention(q_BTHD, k_BSKD, v_BSKD, key_valid_BS, *, window, scale, block_size: int = DEFAULT_BLOCK,
                         implementation: str = "cudnn"):
    """Self-attention through ``jax.nn.dot_product_attention``; rows with holes in their padding go blockwise."""
    B, T = key_valid_BS.shape

    def kernel(q, k, v, valid):
        return _padded_kernel_attention(q, k, v, valid, window=window, scale=scale, implementation=implementation)

    def fallback(q, k, v, valid):
        slots = jnp.broadcast_to(jnp.arange(T), (B, T))
        ones = jnp.ones((B, T), jnp.int32)
        out = blockwise_attention(q, k, v, slots, valid, ones, ones, window=window, scale=scale,
                                  block_q=block_size, block_k=block_size)
        return jnp.where(valid[:, :, None, None], out, 0).astype(q.dtype)

    return jax.lax.cond(_is_one_span(key_valid_BS), kernel, fallback, q_BTHD, k_BSKD, v_BSKD, key_valid_BS)


def splash_self_attention(q_BTHD, k_BSKD, v_BSKD, key_valid_BS, segment_ids_BT=None, *, window, scale,
                          interpret: bool = False):
    """Self-attention through the Pallas splash kernel (one MQA kernel per kv head, vmapped over batch).

    Padding becomes segment 0: splash needs every query to see at least one key, and a padding
    query sees the padding before it (itself at least); its output is then zeroed.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    block = splash_block(T)
    if block is None:
        raise ValueError(f"splash attention needs a sequence length divisible by 128, got {T}")
    seg = jnp.ones((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT.astype(jnp.int32)
    seg = jnp.where(key_valid_BS, seg, 0)
    if window is None:
        head_mask = splash.CausalMask((T, T))
    else:
        head_mask = splash.LocalMask((T, T), window_size=(window - 1, 0), offset=0)
    blocks = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                               block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = splash.make_splash_mqa_single_device(splash.MultiHeadMask([head_mask] * (H // K)),
                                                  block_sizes=blocks, interpret=interpret)

    def one_kv_head(q_GTD, k_TD, v_TD, seg_T):
        return kernel(q_GTD, k_TD, v_TD, segment_ids=splash.SegmentIds(q=seg_T, kv=seg_T))

    per_row = jax.vmap(one_kv_head, in_axes=(0, 0, 0, None))
    q = (q_BTHD * jnp.asarray(scale, q_BTHD.dtype)).reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
    k, v = jnp.transpose(k_BSKD, (0, 2, 1, 3)), jnp.transpose(v_BSKD, (0, 2, 1, 3))
    out = jax.vmap(per_row)(q, k, v, seg)  # (B, K, G, T, D)
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)
    return jnp.where((seg > 0)[:, :, None, None], out, 0).astype(q_BTHD.dtype)
