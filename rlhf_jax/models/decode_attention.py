"""The one-token decode step over the KV cache: the dense multiply-reduce and the Pallas kernels, one entry point.

The cache holds keys (B, K, D, S) and values (B, K, S, D). A query at slot q_b
sees the cache columns that ``attention_weights_mask`` marks: valid keys at or
before it, within its sliding window. ``decode_attention`` computes that with
the implementation ``attention.select_decode_implementation`` picks: the dense
path reads every column of every row; the kernels (``decode_kernels``) read only
the blocks that hold visible columns.

XLA cannot split a Pallas kernel over devices (Mosaic refuses to lower a sharded
call): the kernels run per device under ``shard_map``, over the cache's own rows
and kv heads. Only the caller knows that layout, so it states it: ``"auto"``
picks a kernel only while a ``kernel_layout`` is open (the sampler's decode step
opens one), and the dense path elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from rlhf_jax.models import decode_kernels
from rlhf_jax.models.attention import warn_fallback, select_decode_implementation
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


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """How the KV cache lies on the devices: rows split over mesh axes ``rows``, kv heads over ``heads``."""

    mesh: Mesh
    rows: Any = None  # a mesh axis, a tuple of them, or None (PartitionSpec entries)
    heads: Any = None


_LAYOUT: contextvars.ContextVar[KernelLayout | None] = contextvars.ContextVar("decode_kernel_layout", default=None)


@contextlib.contextmanager
def kernel_layout(mesh: Mesh, rows: Any = None, heads: Any = None):
    """While tracing inside it, decode steps may run the Pallas kernels, per device, on this cache layout."""
    token = _LAYOUT.set(KernelLayout(mesh, rows, heads))
    try:
        yield
    finally:
        _LAYOUT.reset(token)


# lax.platform_dependent's platform names and the backends select_decode_implementation knows them by
PLATFORMS = {"cpu": "cpu", "tpu": "tpu", "cuda": "gpu"}


def decode_attention(q_BHD, k_BKDS, v_BKSD, q_slot_B, key_valid_BS, dtype, window: int | None = None,
                     scale: float | None = None, softcap: float | None = None, *, implementation: str = "auto",
                     interpret: bool = False) -> jax.Array:
    """(B, H, D) output of one query per row (at cache slot ``q_slot_B``, itself valid) over the cache.

    ``implementation`` is one of ``attention.DECODE_IMPLEMENTATIONS``; ``interpret`` runs a Pallas
    kernel in interpret mode (any backend; slow, for tests). The choice is made per platform when the
    program is lowered (``lax.platform_dependent``), not from the backend this process runs on, so a
    program compiled here for a TPU or a GPU (ahead of time) gets that platform's kernel. "auto" runs a
    kernel only inside ``kernel_layout``; a kernel requested by name without one runs unsharded.
    """
    D = q_BHD.shape[-1]
    layout = _LAYOUT.get()
    if implementation == "auto" and layout is None:
        implementation = "dense"
    choices = {p: select_decode_implementation(implementation, b, D, interpret=interpret) for p, b in PLATFORMS.items()}
    here = choices.get({"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend()), ("dense", "other platform"))
    if implementation not in ("auto", here[0]):
        warn_fallback(implementation, here[0], here[1])

    def run(chosen: str):
        return functools.partial(_decode_with, chosen, dtype=dtype, window=window, scale=scale, softcap=softcap,
                                 interpret=interpret, layout=layout)

    args = (q_BHD, k_BKDS, v_BKSD, q_slot_B, key_valid_BS)
    kinds = {chosen for chosen, _ in choices.values()} | {"dense"}
    if len(kinds) == 1:  # one implementation everywhere (dense): no platform switch in the program
        return run("dense")(*args)
    return jax.lax.platform_dependent(*args, default=run("dense"), **{p: run(c) for p, (c, _) in choices.items()})


def _decode_with(chosen: str, q_BHD, k_BKDS, v_BKSD, q_slot_B, key_valid_BS, *, dtype, window, scale, softcap,
                 interpret, layout: KernelLayout | None):
    if chosen == "dense":
        return dense_decode_attention(q_BHD, k_BKDS, v_BKSD, q_slot_B, key_valid_BS, dtype, window, scale, softcap)
    B, H, D = q_BHD.shape
    K = k_BKDS.shape[1]
    visible_BS = attention_weights_mask(q_slot_B[:, None], key_valid_BS, window)[:, 0]
    kernel = decode_kernels.tpu_decode_attention if chosen == "pallas_tpu" else decode_kernels.gpu_decode_attention
    kernel = functools.partial(kernel, scale=D**-0.5 if scale is None else scale, softcap=softcap, interpret=interpret)
    if layout is not None and layout.mesh.size > 1:
        cache, rows = PartitionSpec(layout.rows, layout.heads), PartitionSpec(layout.rows)
        kernel = jax.shard_map(kernel, mesh=layout.mesh, in_specs=(cache, cache, cache, rows, rows), out_specs=cache,
                               check_vma=False)  # a pallas_call states no varying axes of its output
    out = kernel(q_BHD.astype(dtype).reshape(B, K, H // K, D), k_BKDS, v_BKSD, visible_BS, q_slot_B)
    return out.reshape(B, H, D)
