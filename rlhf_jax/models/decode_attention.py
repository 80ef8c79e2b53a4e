"""The one-token decode step over the KV cache: the dense multiply-reduce and the Pallas kernels, one entry point.

The cache holds keys (B, K, D, S) and values (B, K, S, D). A query at slot q_b
sees the cache columns that ``attention_weights_mask`` marks: valid keys at or
before it, within its sliding window. ``decode_attention`` computes that with
the implementation ``attention.select_decode_implementation`` picks: the dense
path reads every column of every row; the kernels (``decode_kernels``) read only
the blocks that hold visible columns.

The kernels run per device on the layout the caller states (``kernel_layout``;
the sampler's decode step states the cache's); "auto" picks one only where
``kernel_layout.kernels_allowed()``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rlhf_jax.models import decode_kernels, kernel_layout
from rlhf_jax.models.attention import PLATFORMS, select_decode_implementation, warn_fallback
from rlhf_jax.models.blockwise import soft_cap


def attention_weights_mask(q_slots_BT: jax.Array, key_valid_BS: jax.Array, window: int | None = None) -> jax.Array:
    """(B, T, S) boolean: a query at slot i sees key slot j when j <= i, the key is valid and, with a
    ``window``, fewer than ``window`` valid keys precede the query from j on.

    The window counts valid slots, not slots: the valid keys are the sequence's tokens in order, but
    the decode cache may hold gaps between them (its last slot stages the fed-back token while the
    response slots before it are not all filled yet).
    """
    key_slots = jnp.arange(key_valid_BS.shape[-1])
    valid = key_valid_BS.astype(bool)
    mask = (key_slots[None, None, :] <= q_slots_BT[:, :, None]) & valid[:, None, :]
    if window is not None:
        rank_BS = jnp.cumsum(valid, axis=-1)
        q_rank_BT = jnp.take_along_axis(rank_BS, q_slots_BT, axis=-1)
        mask &= q_rank_BT[:, :, None] - rank_BS[:, None, :] < window
    return mask


def dense_decode_attention(q_BHD, k_BKDS, v_BKSD, q_slot_B, key_valid_BS, dtype, window: int | None = None,
                           scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """One query token per row over the whole cache, (B, H, D).

    Many tiny matmuls, one per (batch, kv head), are slow on CPU; a broadcast multiply + reduce
    that XLA fuses reads the cache once instead.
    """
    B, H, D = q_BHD.shape
    K = k_BKDS.shape[1]
    q = q_BHD.reshape(B, K, H // K, D)
    scores = jnp.sum(q[..., None] * k_BKDS.astype(dtype)[:, :, None], axis=-2)  # B K G S
    scores = soft_cap(scores.astype(jnp.float32) * (D**-0.5 if scale is None else scale), softcap)
    mask = attention_weights_mask(q_slot_B[:, None], key_valid_BS, window)[:, None]  # B 1 1 S
    probs = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1).astype(dtype)
    out = jnp.sum(probs[..., None] * v_BKSD.astype(dtype)[:, :, None], axis=-2)  # B K G D
    return out.reshape(B, H, D)


def decode_attention(q_BHD, k_BKDS, v_BKSD, q_slot_B, key_valid_BS, dtype, window: int | None = None,
                     scale: float | None = None, softcap: float | None = None, *, implementation: str = "auto",
                     interpret: bool = False) -> jax.Array:
    """(B, H, D) output of one query per row (at cache slot ``q_slot_B``, itself valid) over the cache.

    ``implementation`` is one of ``attention.DECODE_IMPLEMENTATIONS``; ``interpret`` runs a Pallas
    kernel in interpret mode (any backend; slow, for tests). The choice is made per platform when the
    program is lowered (``lax.platform_dependent``), not from the backend this process runs on, so a
    program compiled here for a TPU or a GPU (ahead of time) gets that platform's kernel. A kernel runs
    per device on the current ``kernel_layout`` (unsharded without one).
    """
    D = q_BHD.shape[-1]
    if implementation == "auto" and not kernel_layout.kernels_allowed():
        implementation = "dense"
    choices = {p: select_decode_implementation(implementation, b, D, interpret=interpret) for p, b in PLATFORMS.items()}
    here = choices.get(jax.default_backend().replace("gpu", "cuda"), ("dense", "another platform"))
    if implementation not in ("auto", here[0]):
        warn_fallback(implementation, here[0], here[1])

    def run(chosen: str):
        return functools.partial(_decode_with, chosen, dtype=dtype, window=window, scale=scale, softcap=softcap,
                                 interpret=interpret)

    args = (q_BHD, k_BKDS, v_BKSD, q_slot_B, key_valid_BS)
    kinds = {chosen for chosen, _ in choices.values()} | {"dense"}
    if len(kinds) == 1:  # one implementation everywhere (dense): no platform switch in the program
        return run("dense")(*args)
    return jax.lax.platform_dependent(*args, default=run("dense"), **{p: run(c) for p, (c, _) in choices.items()})


def _decode_with(chosen: str, q_BHD, k_BKDS, v_BKSD, q_slot_B, key_valid_BS, *, dtype, window, scale, softcap,
                 interpret):
    if chosen == "dense":
        return dense_decode_attention(q_BHD, k_BKDS, v_BKSD, q_slot_B, key_valid_BS, dtype, window, scale, softcap)
    B, H, D = q_BHD.shape
    K = k_BKDS.shape[1]
    visible_BS = attention_weights_mask(q_slot_B[:, None], key_valid_BS, window)[:, 0]
    kernel = decode_kernels.tpu_decode_attention if chosen == "pallas_tpu" else decode_kernels.gpu_decode_attention
    kernel = functools.partial(kernel, scale=D**-0.5 if scale is None else scale, softcap=softcap, interpret=interpret)
    layout = kernel_layout.current()
    if layout is not None:
        cache, rows = layout.spec(4, 1, K), layout.spec(1)
        kernel = kernel_layout.per_device(kernel, (cache, cache, cache, layout.spec(2), rows), cache)
    out = kernel(q_BHD.astype(dtype).reshape(B, K, H // K, D), k_BKDS, v_BKSD, visible_BS, q_slot_B)
    return out.reshape(B, H, D)
