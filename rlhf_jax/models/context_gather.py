"""Attention under a sequence split by gathering keys and values: for models whose heads the split cannot divide.

Ulysses (``sequence_split.ulysses_inputs``) splits attention by heads, so it needs the query heads to divide
tensor x context; SmolLM2's 9 query heads and 3 key/value heads divide neither 2, 4 nor 8. This path keeps the
queries where the sequence split put them (each device its T / context tokens) and all-gathers the keys, values,
their validity and segment ids over the ``context`` axis, so each device attends with its own queries over the
whole key/value sequence. The attention itself is the ordinary one (``attention.attention`` with explicit query
slots: device i's queries sit at slots i * T / context + 0, 1, ...), so causal masks, sliding windows, packed
segment ids and prompt-shared rows are the mask ``blockwise.visible`` computes from slot values, unchanged.

It is written with ``jax.shard_map`` manual over the context axis only (the rows' and heads' axes stay automatic),
so the one all-gather per layer is explicit, and its transpose in the backward pass is a reduce-scatter of the
key/value gradients. With grouped-query attention the gathered tensors are small: SmolLM2 at 32k tokens holds
2 (k, v) x 3 heads x 64 x 32768 x 2 bytes = 25 MB a layer in bf16, less than the whole sequence's hidden states
(576 x 32768 x 2 bytes = 38 MB); the queries, scores and everything outside attention stay split.

Why not a ring (each device passing its key/value block to the next, context - 1 times, and merging the partial
softmax results): that needs the attention kernel to return its log-sum-exp and a backward of its own that
passes gradients around the ring too, and its per-step exchanges have to be overlapped by hand; the gather is one
collective per layer that XLA schedules (its gradient, a reduce-scatter, sums in float32), and its memory (the
whole sequence's keys/values on each device, for one layer at a time) is small for GQA models, the ones whose
heads do not split.

Causal work is not balanced: device i's queries see i + 1 of the context chunks, and the blockwise kernel skips
the key blocks above the diagonal, so the last device does about 2 x context / (context + 1) times the mean
work and the step waits for it. Memory, the point of the split, is balanced.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from rlhf_jax.models.sequence_split import SequenceSplit


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_length(x_BT, axis_name):
    """The (B, T / context, ...) pieces of the context group concatenated along T (an all-gather)."""
    return jax.lax.all_gather(x_BT, axis_name, axis=1, tiled=True)


def _gather_fwd(x_BT, axis_name):
    return gather_length(x_BT, axis_name), None


def _gather_bwd(axis_name, _, d_BT):
    # the transpose, a reduce-scatter, sums in float32: the devices' partial key/value gradients keep float32
    # precision (and XLA:CPU fails to compile a bfloat16 reduce-scatter: "Invalid binary instruction opcode copy")
    summed = jax.lax.psum_scatter(d_BT.astype(jnp.promote_types(d_BT.dtype, jnp.float32)), axis_name,
                                  scatter_dimension=1, tiled=True)
    return (summed.astype(d_BT.dtype),)


gather_length.defvjp(_gather_fwd, _gather_bwd)


def gather_attention(split: SequenceSplit, attend: Callable, q_BTHD, k_BSKD, v_BSKD, key_valid_BS,
                     q_segment_ids_BT=None, kv_segment_ids_BS=None) -> jax.Array:
    """``attend(q, k, v, q_slots, key_valid, q_segments, kv_segments)`` on each device's queries (T split over
    context) against the keys/values of the whole sequence, gathered over context; output (B, T, H, D), T split."""
    axes = split.length_axes
    axis_name = axes[0] if len(axes) == 1 else axes
    T = q_BTHD.shape[1]
    if T % split.ways or k_BSKD.shape[1] != T:
        raise ValueError(f"gathered attention needs self-attention over rows that split over mesh.context="
                         f"{split.ways}; got {T} queries and {k_BSKD.shape[1]} keys")
    key_valid_BS = jnp.ones(k_BSKD.shape[:2], bool) if key_valid_BS is None else key_valid_BS.astype(bool)
    segments = () if q_segment_ids_BT is None else (q_segment_ids_BT, kv_segment_ids_BS)

    def local(q, k, v, valid, *segs):
        B, T_local = q.shape[:2]
        slots = jax.lax.axis_index(axis_name) * T_local + jnp.arange(T_local, dtype=jnp.int32)
        gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, axis=1, tiled=True)  # integers
        k, v, valid = gather_length(k, axis_name), gather_length(v, axis_name), gather(valid)
        q_seg, kv_seg = (segs[0], gather(segs[1])) if segs else (None, None)
        return attend(q, k, v, jnp.broadcast_to(slots, (B, T_local)), valid, q_seg, kv_seg)

    by_length = PartitionSpec(None, split.length)
    args = (q_BTHD, k_BSKD, v_BSKD, key_valid_BS) + segments
    # check_vma off: the blockwise kernel's loops start from constants (not varying over context) and carry values
    # that are, which the check would refuse; every input and the output here are split over context anyway
    return jax.shard_map(local, mesh=split.mesh, in_specs=(by_length,) * len(args), out_specs=by_length,
                         axis_names=set(axes), check_vma=False)(*args)
