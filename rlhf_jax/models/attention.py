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
attention on TPU. The implementation is chosen per platform when the program is
lowered (``lax.platform_dependent``), so a program compiled here ahead of time for
a TPU or a GPU gets that platform's kernel; "auto" picks a kernel only where
``kernel_layout.kernels_allowed()`` (the kernels run per device, on the layout the
caller states). These two compute every real query exactly; a query that is
itself padding (its own slot invalid, or segment 0) gets zeros from them, whereas
``dense`` and ``blockwise`` follow the rule above for it too. Being self-attention,
the kernels read the query segment ids for both sides (they are the same tokens).

Under a sequence split (``sequence_split``, the training passes with mesh.context > 1) self-attention runs on
whole sequences with the heads split over tensor x context (Ulysses), or, where the heads do not divide
(``context_attention``), on each device's queries over keys/values gathered over context (``context_gather``);
the caller's activations stay split by length.

The one-token decode step over the KV cache is ``decode_attention.py``; which of its
implementations runs is chosen here too (``select_decode_implementation``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging

import jax
import jax.numpy as jnp

from rlhf_jax.config.names import ATTN_IMPLEMENTATIONS
from rlhf_jax.models import attention_kernels, context_gather, decode_kernels, kernel_layout, sequence_split
from rlhf_jax.models.dots import einsum_f32
from rlhf_jax.models.blockwise import DEFAULT_BLOCK, blockwise_attention, soft_cap, visible

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ATTN_IMPLEMENTATIONS  # model.attn_implementation
# lax.platform_dependent's platform names, and the backend names the selection rules use for them
PLATFORMS = {"cpu": "cpu", "tpu": "tpu", "cuda": "gpu"}

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


DECODE_IMPLEMENTATIONS = ("auto", "dense", "pallas_tpu", "pallas_gpu")


def select_decode_implementation(requested: str, backend: str, head_dim: int, *, interpret: bool = False
                                 ) -> tuple[str, str]:
    """(implementation, reason) of the one-token decode step over the KV cache.

    "auto" is the Pallas kernel of the backend (TPU, GPU), which reads only the cache blocks a query
    sees, and the dense multiply-reduce on CPU: there XLA fuses it into one pass over the cache, and
    every HLO formulation of a per-row prefix was slower. The GPU kernel's Triton tiles need a
    power-of-two head_dim >= 16; other head sizes take the dense path. A kernel requested for another
    backend runs only in Pallas interpret mode (``interpret``, for tests), else falls back to dense.
    """
    if requested not in DECODE_IMPLEMENTATIONS:
        raise ValueError(f"unknown decode attention implementation {requested!r}; expected one of "
                         f"{DECODE_IMPLEMENTATIONS}")
    if requested == "dense":
        return "dense", "requested"
    want = requested if requested != "auto" else {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend)
    if want is None:
        return "dense", f"{backend}: XLA's fused multiply-reduce over the whole cache"
    if want == "pallas_gpu" and not decode_kernels.gpu_head_dim_fits(head_dim):
        return "dense", f"the GPU decode kernel needs a power-of-two head_dim >= 16, not {head_dim}"
    if not interpret and backend != want.removeprefix("pallas_"):
        return "dense", f"{want} compiles only for its platform, not {backend} (interpret mode runs it anywhere)"
    return want, backend


@functools.cache
def _cudnn_traceable() -> bool:
    """Whether cuDNN attention can be traced here: jax checks the cuDNN library's version while tracing it."""
    x = jax.ShapeDtypeStruct((1, 8, 1, 8), jnp.bfloat16)
    try:
        jax.eval_shape(functools.partial(jax.nn.dot_product_attention, implementation="cudnn"), x, x, x)
        return True
    except (RuntimeError, ImportError):
        return False


@functools.cache
def _splash_importable() -> bool:
    try:  # finding the module imports its parent packages, which may fail on a build without Pallas TPU
        return importlib.util.find_spec("jax.experimental.pallas.ops.tpu.splash_attention") is not None
    except ImportError:
        return False


@functools.cache
def warn_fallback(requested: str, chosen: str, reason: str) -> None:
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
              softcap: float | None = None, implementation: str = "auto", block_size: int = DEFAULT_BLOCK,
              context_attention: str = "auto") -> jax.Array:
    """Attention output (B, T, H, D) of queries (B, T, H, D) over keys/values (B, S, K, D); see the module doc.

    ``key_valid_BS`` defaults to all keys valid; segment ids are given for both sides or neither.
    ``block_size`` is the query and key block length of the blockwise path. ``context_attention`` (one of
    ``CONTEXT_ATTENTION``) picks how self-attention runs under a sequence split.
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
    # a sequence split over the context axis (training passes): attend over whole sequences with the heads split
    # (Ulysses), or with each device's queries over the keys/values gathered from the whole sequence
    layout = sequence_split.current() if q_slots_BT is None else None
    path = None if layout is None else layout.attention_path(context_attention, H)
    if path == "gather" and T % layout.ways == 0:  # (rows that do not split over context are whole on each device)
        attend = functools.partial(attention, sliding_window=sliding_window, scale=scale, softcap=softcap,
                                   implementation=implementation, block_size=block_size)
        return context_gather.gather_attention(
            layout, lambda q, k, v, slots, valid, q_seg, kv_seg: attend(
                q, k, v, q_slots_BT=slots, key_valid_BS=valid, q_segment_ids_BT=q_seg, kv_segment_ids_BS=kv_seg),
            q_BTHD, k_BSKD, v_BSKD, key_valid_BS, q_segment_ids_BT, kv_segment_ids_BS)
    split = path == "ulysses"
    if split:
        q_BTHD, k_BSKD, v_BSKD, (key_valid_BS, q_segment_ids_BT, kv_segment_ids_BS) = sequence_split.ulysses_inputs(
            q_BTHD, k_BSKD, v_BSKD, (key_valid_BS, q_segment_ids_BT, kv_segment_ids_BS))
    call = CallShape(T, S, D, jnp.dtype(q_BTHD.dtype).name, q_slots_BT is None, q_segment_ids_BT is not None)
    requested = implementation
    if requested == "auto" and not kernel_layout.kernels_allowed():
        requested = _xla_choice(call)
    choices = {p: _choose(requested, b, call, softcap) for p, b in PLATFORMS.items()}
    here = choices.get(jax.default_backend().replace("gpu", "cuda"), (_xla_choice(call), "another platform"))
    if implementation not in ("auto", here[0]):
        warn_fallback(implementation, here[0], here[1])

    key_valid = jnp.ones((B, S), bool) if key_valid_BS is None else key_valid_BS.astype(bool)
    run = functools.partial(_attend, window=sliding_window, scale=scale, softcap=softcap, block_size=block_size)
    args = (q_BTHD, k_BSKD, v_BSKD, q_slots_BT, key_valid, q_segment_ids_BT, kv_segment_ids_BS)
    if len({chosen for chosen, _ in choices.values()}) == 1:  # the same everywhere: no platform switch
        out = run(here[0], *args)
    else:
        out = jax.lax.platform_dependent(*args, default=functools.partial(run, _xla_choice(call)),
                                         **{p: functools.partial(run, c) for p, (c, _) in choices.items()})
    return sequence_split.ulysses_output(out) if split else out


def _choose(requested: str, backend: str, call: CallShape, softcap: float | None) -> tuple[str, str]:
    """``select_implementation`` for ``backend``, with what this process can trace and the scores' cap."""
    available = {"tpu": _splash_importable, "gpu": _cudnn_traceable}.get(backend, lambda: True)
    chosen, reason = select_implementation(requested, backend, call, splash_available=backend == "tpu" and available())
    if chosen == "cudnn" and not available():
        return _xla_choice(call), "cuDNN cannot be traced here (no CUDA plugin or cuDNN library)"
    if softcap is not None and chosen in ("cudnn", "splash"):  # the kernel wrappers do not cap scores
        return _xla_choice(call), "the fused kernels do not soft-cap attention scores"
    return chosen, reason


def _attend(chosen: str, q_BTHD, k_BSKD, v_BSKD, q_slots_BT, key_valid, q_segment_ids_BT, kv_segment_ids_BS, *,
            window, scale, softcap, block_size):
    B, T, H, D = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    if chosen in ("cudnn", "splash"):
        layout = kernel_layout.current()
        heads = layout.spec(4, 2, K) if layout is not None else None
        rows2 = layout.spec(2) if layout is not None else None
        if chosen == "cudnn":
            def kernel(q, k, v, valid):
                return attention_kernels.cudnn_self_attention(q, k, v, valid, window=window, scale=scale,
                                                              block_size=block_size)
            return kernel_layout.per_device(kernel, (heads, heads, heads, rows2), heads)(q_BTHD, k_BSKD, v_BSKD,
                                                                                         key_valid)

        def kernel(q, k, v, valid, *seg):
            return attention_kernels.splash_self_attention(q, k, v, valid, *seg, window=window, scale=scale)
        segments = () if q_segment_ids_BT is None else (q_segment_ids_BT,)
        return kernel_layout.per_device(kernel, (heads, heads, heads) + (rows2,) * (1 + len(segments)), heads)(
            q_BTHD, k_BSKD, v_BSKD, key_valid, *segments)
    q_slots = jnp.broadcast_to(jnp.arange(T), (B, T)) if q_slots_BT is None else q_slots_BT
    q_seg = jnp.ones((B, T), jnp.int32) if q_segment_ids_BT is None else q_segment_ids_BT
    kv_seg = jnp.ones((B, S), jnp.int32) if kv_segment_ids_BS is None else kv_segment_ids_BS
    if chosen == "dense":
        return dense_attention(q_BTHD, k_BSKD, v_BSKD, q_slots, key_valid, q_seg, kv_seg, window=window, scale=scale,
                               softcap=softcap)
    return blockwise_attention(q_BTHD, k_BSKD, v_BSKD, q_slots, key_valid, q_seg, kv_seg, window=window,
                               scale=scale, block_q=block_size, block_k=block_size, softcap=softcap)
