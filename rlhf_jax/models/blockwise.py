"""Flash-style attention in plain XLA: the (T, S) score matrix never exists whole.

Queries and keys are cut into blocks; the forward keeps a running maximum and
normaliser per query (online softmax) while it walks the key blocks, and saves
only the output and the log-sum-exp. The backward (a ``jax.custom_vjp``)
recomputes each block's probabilities from that log-sum-exp: differentiating
through the loop instead would store every block's probabilities, which is the
quadratic memory this module exists to avoid. Blocks that no query of the block
may see (above the causal diagonal, outside the window, other segments, padding)
are skipped in both directions. Scores may be soft-capped (``cap * tanh(s / cap)``,
Gemma 2); the backward then scales the score gradient by the cap's derivative.

Blocked layouts (n = number of blocks): queries (nq, B, K, G, Bq, D), keys and
values (nk, B, K, Bk, D), per-query slots/segments (nq, B, Bq), per-key
validity/segments (nk, B, Bk). The key slot of position j of key block i is
i * Bk + j.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rlhf_jax.models.dots import einsum_f32
from rlhf_jax.models.remat import after

# Segment id bits that number the responses sharing one packed prompt (see rlhf_jax.batch.packing).
BRANCH_BITS = 12

# 128 was the fastest or tied on CPU for T = 128 ... 4096 (SmolLM2 heads) against 256 and 512.
DEFAULT_BLOCK = 128


def visible(q_slots_BT, q_seg_BT, key_slots_S, key_valid_BS, kv_seg_BS, window: int | None) -> jax.Array:
    """(B, T, S) boolean: query i sees key j (valid, causal by slot, in the window, and of the same non-zero
    segment or of the query's shared prompt: segment ``(q >> BRANCH_BITS) << BRANCH_BITS``, see
    ``rlhf_jax.batch.packing``; for ids below ``1 << BRANCH_BITS`` that is 0, i.e. no other segment)."""
    qs, ks = q_slots_BT[:, :, None], key_slots_S[None, None, :]
    mask = key_valid_BS[:, None, :] & (ks <= qs)
    q_seg, kv_seg = q_seg_BT[:, :, None], kv_seg_BS[:, None, :]
    prompt_seg = (q_seg >> BRANCH_BITS) << BRANCH_BITS
    mask &= ((kv_seg == q_seg) | (kv_seg == prompt_seg)) & (q_seg != 0) & (kv_seg != 0)
    if window is not None:
        mask &= qs - ks < window
    return mask


def _block_mask(qi, ki, q_slots, q_seg, key_valid, kv_seg, block_k: int, window):
    key_slots = ki * block_k + jnp.arange(block_k)
    return visible(q_slots[qi], q_seg[qi], key_slots, key_valid[ki], kv_seg[ki], window)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (identity without a cap): Gemma 2's attention and final logit capping."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def _scores(q_blk, k_blk, softcap):
    return soft_cap(einsum_f32("bkgqd,bksd->bkgqs", q_blk, k_blk), softcap)


def _forward_q_block(qi, q, k, v, q_slots, q_seg, key_valid, kv_seg, window, block_k, softcap):
    """Output (B, K, G, Bq, D) float32 and log-sum-exp (B, K, G, Bq) of one query block."""
    q_blk = q[qi]
    stats_shape = q_blk.shape[:-1]
    init = (
        jnp.full(stats_shape, -jnp.inf, jnp.float32),  # running max
        jnp.zeros(stats_shape, jnp.float32),  # running normaliser
        jnp.zeros(q_blk.shape, jnp.float32),  # running numerator
    )

    def step(ki, carry):
        mask = _block_mask(qi, ki, q_slots, q_seg, key_valid, kv_seg, block_k, window)[:, None, None]

        def update(carry):
            m, l, acc = carry
            s = jnp.where(mask, _scores(q_blk, k[ki], softcap), -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            # A row that has seen nothing yet keeps max -inf; shift it by 0 so exp gives 0, not nan.
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + p.sum(-1)
            pv = einsum_f32("bkgqs,bksd->bkgqd", p.astype(v.dtype), v[ki])
            return m_new, l, alpha[..., None] * acc + pv

        return jax.lax.cond(mask.any(), update, lambda c: c, carry)

    m, l, acc = jax.lax.fori_loop(0, k.shape[0], step, init)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return out, lse


def _zeros_after(shape, dtype, anchor: jax.Array) -> jax.Array:
    """Zeros that XLA cannot create before ``anchor`` exists: the buffer a loop writes its blocks into. A plain
    ``jnp.zeros`` depends on nothing, and XLA:CPU's scheduler creates such buffers at the start of the program, so
    a 30-layer pass held every layer's output and key/value-gradient buffers at once (SmolLM2: 46 KiB a token of
    float32 key/value gradients that no split along the sequence divides)."""
    return after(jnp.zeros(shape, dtype), anchor)


def _forward(q, k, v, q_slots, q_seg, key_valid, kv_seg, window, block_k, softcap):
    """Output (nq, B, K, G, Bq, D) in q's dtype and log-sum-exp (nq, B, K, G, Bq) float32, one query block at a
    time into buffers made after ``q`` (``_zeros_after``)."""
    def one(qi, outs):
        out_blk, lse_blk = _forward_q_block(qi, q, k, v, q_slots, q_seg, key_valid, kv_seg, window, block_k, softcap)
        return outs[0].at[qi].set(out_blk.astype(q.dtype)), outs[1].at[qi].set(lse_blk)

    init = (_zeros_after(q.shape, q.dtype, q), _zeros_after(q.shape[:-1], jnp.float32, q))
    return jax.lax.fori_loop(0, q.shape[0], one, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def blockwise_blocked(q, k, v, q_slots, q_seg, key_valid, kv_seg, window, block_k, softcap=None):
    """Attention over blocked layouts (see the module docstring); ``q`` is already scaled."""
    return _forward(q, k, v, q_slots, q_seg, key_valid, kv_seg, window, block_k, softcap)[0]


def _fwd(q, k, v, q_slots, q_seg, key_valid, kv_seg, window, block_k, softcap):
    out, lse = _forward(q, k, v, q_slots, q_seg, key_valid, kv_seg, window, block_k, softcap)
    return out, (q, k, v, q_slots, q_seg, key_valid, kv_seg, out, lse)


def _bwd(window, block_k, softcap, residuals, d_out):
    """One pass over key blocks; for each, the query blocks that see it: dk, dv per key block, dq accumulated."""
    q, k, v, q_slots, q_seg, key_valid, kv_seg, out, lse = residuals
    d_out = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1)  # (nq, B, K, G, Bq): rowsum(dO * O)

    def key_block(ki, carry):
        dq, dk_all, dv_all = carry
        k_blk, v_blk = k[ki], v[ki]

        def query_block(qi, carry):
            dq, dk, dv = carry
            mask = _block_mask(qi, ki, q_slots, q_seg, key_valid, kv_seg, block_k, window)[:, None, None]

            def update(carry):
                dq, dk, dv = carry
                q_blk, g_blk = q[qi], d_out[qi]
                s = _scores(q_blk, k_blk, softcap)
                p = jnp.where(mask, jnp.exp(s - lse[qi][..., None]), 0.0)
                dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p, g_blk)
                dp = einsum_f32("bkgqd,bksd->bkgqs", g_blk, v_blk)
                ds = p * (dp - delta[qi][..., None])
                if softcap is not None:  # d(cap tanh(x / cap)) / dx = 1 - tanh^2 = 1 - (s / cap)^2
                    ds = ds * (1.0 - jnp.square(s / softcap))
                dk = dk + einsum_f32("bkgqs,bkgqd->bksd", ds, q_blk)
                dq_blk = einsum_f32("bkgqs,bksd->bkgqd", ds, k_blk)
                return dq.at[qi].add(dq_blk), dk, dv

            return jax.lax.cond(mask.any(), update, lambda c: c, carry)

        zeros = jnp.zeros(k_blk.shape, jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(0, q.shape[0], query_block, (dq, zeros, zeros))
        return dq, dk_all.at[ki].set(dk.astype(k.dtype)), dv_all.at[ki].set(dv.astype(v.dtype))

    # the gradients' buffers are made after d_out (``_zeros_after``), not at the program's start
    init = (_zeros_after(q.shape, jnp.float32, d_out), _zeros_after(k.shape, k.dtype, d_out),
            _zeros_after(v.shape, v.dtype, d_out))
    dq, dk, dv = jax.lax.fori_loop(0, k.shape[0], key_block, init)
    return dq.astype(q.dtype), dk, dv, None, None, None, None




blockwise_blocked.defvjp(_fwd, _bwd)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _to_blocks(x, axis: int, block: int, fill):
    """Pad ``axis`` to a multiple of ``block`` with ``fill`` and move the block index to the front."""
    n = x.shape[axis]
    padded = _round_up(n, block)
    if padded != n:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, padded - n)
        x = jnp.pad(x, widths, constant_values=fill)
    x = x.reshape(x.shape[:axis] + (padded // block, block) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def blockwise_attention(q_BTHD, k_BSKD, v_BSKD, q_slots_BT, key_valid_BS, q_seg_BT, kv_seg_BS, *,
                        window: int | None, scale: float, block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK,
                        softcap: float | None = None):
    """Masked attention (B, T, H, D) with memory linear in T and S; all mask inputs are explicit arrays."""
    B, T, H, D = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    bq, bk = min(block_q, _round_up(T, 8)), min(block_k, _round_up(S, 8))
    q = (q_BTHD * jnp.asarray(scale, q_BTHD.dtype)).reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
    q = _to_blocks(q, 3, bq, 0)  # (nq, B, K, G, Bq, D)
    k = _to_blocks(jnp.swapaxes(k_BSKD, 1, 2), 2, bk, 0)  # (nk, B, K, Bk, D)
    v = _to_blocks(jnp.swapaxes(v_BSKD, 1, 2), 2, bk, 0)
    # Padding queries get slot -1 (they see no key); padding keys are invalid.
    slots = _to_blocks(q_slots_BT.astype(jnp.int32), 1, bq, -1)
    q_seg = _to_blocks(q_seg_BT.astype(jnp.int32), 1, bq, 0)
    valid = _to_blocks(key_valid_BS.astype(bool), 1, bk, False)
    kv_seg = _to_blocks(kv_seg_BS.astype(jnp.int32), 1, bk, 0)
    out = blockwise_blocked(q, k, v, slots, q_seg, valid, kv_seg, window, bk, softcap)  # (nq, B, K, G, Bq, D)
    out = jnp.moveaxis(out, 0, 3).reshape(B, K, H // K, -1, D)[:, :, :, :T]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)
