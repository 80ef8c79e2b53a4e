"""Pallas decode attention that reads only the cache blocks a query can see: one kernel for TPU, one for GPU.

One query token per row attends over the row's KV cache, keys (B, K, D, S) and
values (B, K, S, D), the layout the sampler keeps (``layers.Attention``). The
dense path reads all S columns of every row at every step; a slot of the
continuous-batching sampler has filled only its prompt and the response so far
(plus the staging column at the end, where the query itself sits), so most of
its cache is unused early in a response.

The visible columns of row b (``visible_BS``, the dense path's mask) lie in
[lo_b, mid_b] plus the query's own column q_b, where lo_b is the first visible
column and mid_b the last one before q_b. Both kernels walk the blocks of
``block`` columns that cover [lo_b, mid_b], then q_b's block when it is not
among them: ``visits(b)`` blocks, the j-th being ``visited_block(j)``. No other
column is read. Within a block, a column counts when ``visible_BS`` says so
(holes in a prompt's mask, a refilled slot's stale columns, the sliding window).

- TPU (Mosaic): a grid (B, K, blocks) whose key/value block index comes from
  per-row scalars prefetched to SMEM; steps past a row's last visit repeat its
  last block index, and the pipeline does not fetch a block it already holds,
  so those steps read nothing and compute nothing.
- GPU (Triton): a grid (B, K) whose program loops over the row's visits with
  masked loads (Triton tensors need power-of-two sizes: head_dim a power of two,
  the G query heads of a kv head padded to 16 rows for ``tl.dot``).

Both are an online softmax in float32 (FlashAttention's running max and sum);
``interpret=True`` runs either on any backend (the CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

TPU_BLOCK = 256  # cache columns per TPU block: a multiple of the 128-lane tile
GPU_BLOCK = 64  # cache columns per GPU loop step (a power of two, at least 16 for tl.dot)
GPU_MIN_ROWS = 16  # tl.dot needs at least 16 rows
_NEG = float(jnp.finfo(jnp.float32).min)


def gpu_head_dim_fits(head_dim: int) -> bool:
    """The Triton kernel loads (head_dim, block) tiles: head_dim must be a power of two, at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def block_plan(visible_BS: jax.Array, q_slot_B: jax.Array, block: int):
    """Per row (int32 (B,) each): first visited block, blocks in [lo, mid], the query's block, visits in all."""
    S = visible_BS.shape[1]
    cols = jnp.arange(S)[None, :]
    lo = jnp.argmax(visible_BS, axis=1).astype(jnp.int32)
    before = visible_BS & (cols < q_slot_B[:, None])
    has_before = jnp.any(before, axis=1)
    mid = jnp.max(jnp.where(before, cols, -1), axis=1).astype(jnp.int32)
    q_blk = (q_slot_B // block).astype(jnp.int32)
    lo_blk = jnp.where(has_before, lo // block, q_blk)
    main = jnp.where(has_before, mid // block - lo_blk + 1, 0)
    visits = jnp.where(has_before & (mid // block == q_blk), main, main + 1)
    return lo_blk, main, q_blk, visits


def visited_block(j, lo_blk, main, q_blk):
    """The j-th block a row visits: [lo, mid]'s blocks in order, then the query's block (from then on)."""
    return jnp.where(j < main, lo_blk + j, q_blk)


def _online_softmax_step(q, k, v, visible, m, l, acc, *, scale, softcap):
    """One block of keys (D, n) and values (n, D) into the running max m (G, 1), sum l (G, 1) and output acc (G, D)."""
    s = jnp.dot(q, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(visible, s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(visible, jnp.exp(s - m_new), 0.0)  # masked columns add nothing even before a visible key is seen
    correction = jnp.exp(m - m_new)
    l = correction * l + jnp.sum(p, axis=1, keepdims=True)
    acc = correction * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l, acc


# ------------------------------------------------------------------------------------------------ TPU


def _tpu_kernel(lo_ref, main_ref, qblk_ref, visits_ref, q_ref, k_ref, v_ref, vis_ref, o_ref, m_ref, l_ref, acc_ref,
                *, block: int, seq_len: int, scale: float, softcap: float | None):
    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j < visits_ref[b])
    def _visit():
        start = visited_block(j, lo_ref[b], main_ref[b], qblk_ref[b]) * block
        cols = start + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        in_range = cols < seq_len  # the last block may reach past the cache; its tail is undefined
        visible = (vis_ref[...] > 0) & in_range
        v = v_ref[...]
        if seq_len % block:
            v = jnp.where(jnp.transpose(in_range), v, jnp.zeros_like(v))
        m, l, acc = _online_softmax_step(q_ref[...], k_ref[...], v, visible, m_ref[...], l_ref[...], acc_ref[...],
                                         scale=scale, softcap=softcap)
        m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

    @pl.when(j == pl.num_programs(2) - 1)
    def _write():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def tpu_decode_attention(q_BKGD, k_BKDS, v_BKSD, visible_BS, q_slot_B, *, scale: float, softcap: float | None = None,
                         block: int | None = None, interpret: bool = False) -> jax.Array:
    """(B, K, G, D) attention output of one query per row over the visible cache columns, TPU kernel."""
    from jax.experimental.pallas import tpu as pltpu  # on use (the Mosaic TPU dialect), as Triton's below

    B, K, G, D = q_BKGD.shape
    S = k_BKDS.shape[3]
    block = block or TPU_BLOCK
    block = S if S <= block else block  # a block is a multiple of 128 columns or the whole cache
    plan = block_plan(visible_BS, q_slot_B, block)

    def kv_block(b, h, j, lo, main, qblk, visits):
        return visited_block(j, lo[b], main[b], qblk[b])

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(B, K, pl.cdiv(S, block)),
        in_specs=[
            pl.BlockSpec((None, None, G, D), lambda b, h, j, *_: (b, h, 0, 0)),
            pl.BlockSpec((None, None, D, block), lambda b, h, j, *s: (b, h, 0, kv_block(b, h, j, *s))),
            pl.BlockSpec((None, None, block, D), lambda b, h, j, *s: (b, h, kv_block(b, h, j, *s), 0)),
            pl.BlockSpec((None, 1, block), lambda b, h, j, *s: (b, 0, kv_block(b, h, j, *s))),
        ],
        out_specs=pl.BlockSpec((None, None, G, D), lambda b, h, j, *_: (b, h, 0, 0)),
        scratch_shapes=[pltpu.VMEM((G, 1), jnp.float32), pltpu.VMEM((G, 1), jnp.float32),
                        pltpu.VMEM((G, D), jnp.float32)],
    )
    kernel = functools.partial(_tpu_kernel, block=block, seq_len=S, scale=scale, softcap=softcap)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, K, G, D), q_BKGD.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="decode_attention_tpu",
    )(*plan, q_BKGD, k_BKDS, v_BKSD, visible_BS.astype(jnp.int32)[:, None, :])


# ------------------------------------------------------------------------------------------------ GPU


def _gpu_kernel(lo_ref, main_ref, qblk_ref, visits_ref, q_ref, k_ref, v_ref, vis_ref, o_ref,
                *, block: int, seq_len: int, scale: float, softcap: float | None):
    from jax.experimental.pallas import triton as plgpu

    lo, main, qblk = lo_ref[...], main_ref[...], qblk_ref[...]
    q = q_ref[...]
    rows, D = q.shape

    def body(j, carry):
        start = visited_block(j, lo, main, qblk) * block
        cols = start + jnp.arange(block)
        in_range = cols < seq_len
        k = plgpu.load(k_ref.at[:, pl.ds(start, block)], mask=in_range[None, :], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(start, block), :], mask=in_range[:, None], other=0.0)
        visible = plgpu.load(vis_ref.at[pl.ds(start, block)], mask=in_range, other=0) > 0
        return _online_softmax_step(q, k, v, visible[None, :], *carry, scale=scale, softcap=softcap)

    init = (jnp.full((rows, 1), _NEG, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, visits_ref[...], body, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)).astype(o_ref.dtype)  # padding rows have l = 0


def gpu_decode_attention(q_BKGD, k_BKDS, v_BKSD, visible_BS, q_slot_B, *, scale: float, softcap: float | None = None,
                         block: int | None = None, interpret: bool = False) -> jax.Array:
    """(B, K, G, D) attention output of one query per row over the visible cache columns, GPU (Triton) kernel."""
    from jax.experimental.pallas import triton as plgpu

    B, K, G, D = q_BKGD.shape
    block = block or GPU_BLOCK
    S = k_BKDS.shape[3]
    if not gpu_head_dim_fits(D):
        raise ValueError(f"the GPU decode kernel needs a power-of-two head_dim >= 16, got {D}")
    rows = max(GPU_MIN_ROWS, pl.next_power_of_2(G))
    q = jnp.pad(q_BKGD, ((0, 0), (0, 0), (0, rows - G), (0, 0)))
    plan = block_plan(visible_BS, q_slot_B, block)
    scalar = pl.BlockSpec((None,), lambda b, h: (b,))
    kernel = functools.partial(_gpu_kernel, block=block, seq_len=S, scale=scale, softcap=softcap)
    out = pl.pallas_call(
        kernel,
        grid=(B, K),
        in_specs=[scalar] * 4 + [
            pl.BlockSpec((None, None, rows, D), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, D, S), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, S, D), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, S), lambda b, h: (b, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, D), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, K, rows, D), q_BKGD.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="decode_attention_gpu",
    )(*plan, q, k_BKDS, v_BKSD, visible_BS.astype(jnp.int32))
    return out[:, :, :G]
