"""The one attention entry point for every call with more than one query token (training, prefill).

``attention(q, k, v, ...)`` computes, per batch row b and query i,

    softmax over the keys j that query i sees of (q_i . k_j) * scale, applied to v

where query (b, i) sees key (b, j) iff ``key_valid[b, j]``, ``j <= q_slots[b, i]``
(a key's slot is its index), and, when given, the key's segment is the query's or that of
the prompt the query's response shares (sequence packing, ``blockwise.visible``) and ``q_slots[b, i] - j < sliding_window``. With ``softcap`` the scores are
``softcap * tanh(scores / softcap)`` (Gemma 2); the fused kernels do not cap, so capped calls take
the dense or blockwise path. H query heads share
K key/value heads (grouped-query attention, G = H // K). A query that sees no key
gives zeros (and a finite gradient).

``q_slots=None`` states that this is self-attention over one sequence (T == S, query
i at slot i). Only then can the fused kernels run, because their causal mask is
static: cuDNN through ``jax.nn.dot_product_attention`` on GPU, Pallas splash
attention on TPU. These two compute every real query exactly; a query that is
itself padding (its own slot invalid, or segment 0) gets zeros from them, whereas
``dense`` and ``blockwise`` follow the rule above for it too. Being self-attention,
the kernels read the query segment ids for both sides (they are the same tokens).

The one-token decode step over the KV cache is not here: it lives in
``layers.Attention`` as a fused multiply-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging

import jax
import jax.numpy as jnp

from rlhf_jax.models import attention_kernels
from rlhf_jax.parallel.backend import compile_backend
from rlhf_jax.models.dots import einsum_f32
from rlhf_jax.models.blockwise import DEFAULT_BLOCK, blockwise_attention, soft_cap, visible

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "dense", "blockwise", "cudnn", "splash")

# Query x key pairs up to which "auto" keeps the dense formula. Measured on a 2-core CPU with
# SmolLM2 heads (H=9, K=3, D=64): attention alone, batch 1, the two tie at T = 64 and 128 and
# blockwise wins from T = 256 (T=1024: dense 85 / 585 ms, blockwise 24 / 74 ms fwd / fwd+bwd).
# Inside the whole 30-layer SmolLM2 forward+backward on 24 packed rows of 256 tokens, though, dense
# took 52 s and blockwise 74 s (its recomputing backward costs more than the 256 x 256 scores it
# saves), so dense is kept up to 256 x 256; the memory plan accounts for the scores it keeps.
DENSE_MAX_PAIRS = 256 * 256


@dataclasses.dataclass(frozen=True)
class CallShape:
    """What the implementation choice depends on: static facts about one call."""

    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    self_attention: bool
    has_segments: bool


def _cudnn_fits(call: CallShape) -> bool:
    # cuDNN flash attention: 16-bit inputs, head_dim a multiple of 8 up to 128; packing would need
    # segment offsets, which this wrapper does not build.
    return (call.self_attention and not call.has_segments and call.dtype in ("bfloat16", "float16")
            and call.head_dim % 8 == 0 and call.head_dim <= 128)


def _splash_fits(call: CallShape) -> bool:
    # Splash's segment mask is equality only; packed rows also let a response see its shared prompt.
    return call.self_attention and not call.has_segments and attention_kernels.splash_block(call.q_len) is not None


def _xla_choice(call: CallShape) -> str:
    return "dense" if call.q_len * call.kv_len <= DENSE_MAX_PAIRS else "blockwise"


def select_implementation(requested: str, backend: str, call: CallShape, *, splash_available: bool = True) -> tuple[str, str]:
    """(implementation, reason). A requested kernel that cannot run here falls back to an XLA path."""
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {requested!r}; expected one of {IMPLEMENTATIONS}")
    if requested in ("dense", "blockwise"):
        return requested, "requested"
    want_cudnn = requested == "cudnn" or (requested == "auto" and backend == "gpu")
    want_splash = requested == "splash" or (requested == "auto" and backend == "tpu")
    if want_cudnn:
        if backend == "gpu" and _cudnn_fits(call):
            return "cudnn", "gpu"
        reason = "cuDNN needs a GPU, self-attention without segment ids, 16-bit inputs and head_dim <= 128"
    elif want_splash:
        if backend == "tpu" and splash_available and _splash_fits(call):
            return "splash", "tpu"
        reason = ("splash needs a TPU, jax's Pallas TPU ops, and self-attention without segment ids over a "
                  "multiple of 128 tokens")
    else:
        reason = f"{backend}: {call.q_len} x {call.kv_len} pairs vs dense limit {DENSE_MAX_PAIRS}"
    return _xla_choice(call), reason


@functools.cache
def _splash_importable() -> bool:
    try:  # finding the module imports its parent packages, which may fail on a build without Pallas TPU
        return importlib.util.find_spec("jax.experimental.pallas.ops.tpu.splash_attention") is not None
    except ImportError:
        return False


@functools.cache
def _warn_fallback(requested: str, chosen: str, reason: str) -> None:
    log.warning("attention implementation %r cannot run here (%s); using %r", requested, reason, chosen)


def dense_attention(q_BTHD, k_BSKD, v_BSKD, q_slots_BT, key_valid_BS, q_seg_BT, kv_seg_BS, *, window, scale,
                    softcap=None):
    """Masked softmax attention with the whole (B, K, G, T, S) score tensor: fastest for short sequences."""
    B, T, H, D = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    q = q_BTHD.reshape(B, T, K, H // K, D)
    scores = soft_cap(einsum_f32("btkgd,bskd->bkgts", q, k_BSKD) * scale, softcap)
    mask = visible(q_slots_BT, q_seg_BT, jnp.arange(S), key_valid_BS, kv_seg_BS, window)[:, None, None]
    # Multiplying by the mask turns the uniform softmax of a row that sees nothing into zeros.
    probs = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1) * mask
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_BSKD.dtype), v_BSKD)
    return out.reshape(B, T, H, D)


def attention(q_BTHD, k_BSKD, v_BSKD, *, q_slots_BT=None, key_valid_BS=None, q_segment_ids_BT=None,
              kv_segment_ids_BS=None, sliding_window: int | None = None, scale: float | None = None,
              softcap: float | None = None, implementation: str = "auto", block_size: int = DEFAULT_BLOCK) -> jax.Array:
    """Attention output (B, T, H, D) of queries (B, T, H, D) over keys/values (B, S, K, D); see the module doc.

    ``key_valid_BS`` defaults to all keys valid; segment ids are given for both sides or neither.
    ``block_size`` is the query and key block length of the blockwise path.
    """
    B, T, H, D = q_BTHD.shape
    S = k_BSKD.shape[1]
    if (q_segment_ids_BT is None) != (kv_segment_ids_BS is None):
        raise ValueError("pass segment ids for both queries and keys, or for neither")
    if q_slots_BT is None and T != S:
        raise ValueError(f"q_slots_BT=None means self-attention, but there are {T} queries and {S} keys")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    scale = D**-0.5 if scale is None else scale
    call = CallShape(T, S, D, jnp.dtype(q_BTHD.dtype).name, q_slots_BT is None, q_segment_ids_BT is not None)
    backend = compile_backend()
    chosen, reason = select_implementation(implementation, backend, call,
                                           splash_available=backend == "tpu" and _splash_importable())
    if softcap is not None and chosen in ("cudnn", "splash"):  # the kernel wrappers do not cap scores
        chosen, reason = _xla_choice(call), "the fused kernels do not soft-cap attention scores"
    if implementation not in ("auto", chosen):
        _warn_fallback(implementation, chosen, reason)

    key_valid = jnp.ones((B, S), bool) if key_valid_BS is None else key_valid_BS.astype(bool)
    if chosen == "cudnn":
        return attention_kernels.cudnn_self_attention(q_BTHD, k_BSKD, v_BSKD, key_valid, window=sliding_window,
                                                      scale=scale, block_size=block_size)
    if chosen == "splash":
        return attention_kernels.splash_self_attention(q_BTHD, k_BSKD, v_BSKD, key_valid, q_segment_ids_BT,
                                                       window=sliding_window, scale=scale)
    q_slots = jnp.broadcast_to(jnp.arange(T), (B, T)) if q_slots_BT is None else q_slots_BT
    q_seg = jnp.ones((B, T), jnp.int32) if q_segment_ids_BT is None else q_segment_ids_BT
    kv_seg = jnp.ones((B, S), jnp.int32) if kv_segment_ids_BS is None else kv_segment_ids_BS
    if chosen == "dense":
        return dense_attention(q_BTHD, k_BSKD, v_BSKD, q_slots, key_valid, q_seg, kv_seg, window=sliding_window, scale=scale,
                               softcap=softcap)
    return blockwise_attention(q_BTHD, k_BSKD, v_BSKD, q_slots, key_valid, q_seg, kv_seg, window=sliding_window,
                               scale=scale, block_q=block_size, block_k=block_size, softcap=softcap)
