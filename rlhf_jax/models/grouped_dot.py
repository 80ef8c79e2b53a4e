"""Grouped matrix products for the MoE experts: rows sorted by group (expert), row r of group g times w[g].

Two ways, chosen by platform and size (``implementation``):

- ``ragged``: ``jax.lax.ragged_dot``. XLA:TPU runs it natively. XLA:GPU and XLA:CPU (jax 0.10) expand it into a
  dense product over every group, each row placed in all X groups' slots: X times the FLOPs, and an (X, rows,
  width) temporary. For Qwen3-30B-A3B (128 experts) at 4096 tokens per H100 that planned to 1.2 TiB.
- ``blocked``: each group's rows padded to a multiple of ``BLOCK`` and cut into blocks of one group each, then one
  batched product of the blocks with their groups' weights (gathered per block). At most rows / BLOCK + X blocks
  (static), so the padding costs at most X * BLOCK rows and the gathered weights (blocks, in, out) are transient;
  a batched GEMM is what GPUs run well. The gradients are written out (the weights': a scatter-add of the blocks'),
  with every buffer made after the incoming gradient so that no layer's is created before its backward runs.

The placement (which padded slot each row takes, which group each block computes) depends only on the group
sizes, so ``plan`` is computed once per layer and shared by its products.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Iterator

import jax
import jax.numpy as jnp

from rlhf_jax.models.remat import after
from rlhf_jax.parallel.backend import compile_backend

IMPLEMENTATIONS = ("ragged", "blocked")
BLOCK = 128  # rows per block: an MMA-friendly tile height on GPUs


_CHOSEN: contextvars.ContextVar[str | None] = contextvars.ContextVar("grouped_dot", default=None)


def implementation(backend: str | None = None, rows: int | None = None, groups: int = 1,
                   width: tuple[int, int] | None = None) -> str:
    """"ragged" where XLA keeps ``ragged_dot`` grouped (TPU), "blocked" elsewhere, except where the expansion is the
    smaller of the two (few rows, as in a decode step: rows x groups x (in + out) against the blocks' gathered
    weights, (rows / BLOCK + groups) x in x out); inside ``using(how)``, ``how``."""
    if _CHOSEN.get():
        return _CHOSEN.get()
    if (backend or compile_backend()) == "tpu":
        return "ragged"
    if rows is not None and width is not None:
        expanded = rows * groups * (width[0] + width[1])
        gathered = (-(-rows // _block(rows, groups)) + groups) * width[0] * width[1]
        return "ragged" if expanded < gathered else "blocked"
    return "blocked"


def _block(rows: int, groups: int, block: int = BLOCK) -> int:
    """Rows per block: ``block``, or the power of two at or above rows / groups where that is smaller."""
    return min(block, 1 << max(0, (-(-rows // groups) - 1).bit_length()))


@contextlib.contextmanager
def using(how: str) -> Iterator[None]:
    """While tracing inside it, the grouped products take ``how`` on any platform (to measure or compare them)."""
    token = _CHOSEN.set(_checked(how))
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def _checked(how: str) -> str:
    if how not in IMPLEMENTATIONS:
        raise ValueError(f"grouped product {how!r} is not one of {IMPLEMENTATIONS}")
    return how


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """How M rows sorted by group are laid out for the products."""

    sizes: jax.Array  # (X,) rows per group
    slots: jax.Array | None  # (M,) each row's padded slot (blocked)
    block_groups: jax.Array | None  # (blocks,) the group of each block (blocked)
    block: int = dataclasses.field(metadata=dict(static=True), default=0)  # rows per block; 0: ragged


def plan(sizes_X: jax.Array, rows: int, how: str | None = None, block: int = BLOCK,
         width: tuple[int, int] | None = None) -> GroupPlan:
    """The layout of ``rows`` rows sorted by group, ``sizes_X`` rows in each group (summing to ``rows``); blocks of
    ``block`` rows, or of the power of two at or above rows / groups where that is smaller; ``width``: the (in,
    out) sizes of the products, which let ``implementation`` weigh the two ways."""
    how = _checked(how or implementation(rows=rows, groups=sizes_X.shape[0], width=width))
    if how == "ragged":
        return GroupPlan(sizes_X, None, None)
    X = sizes_X.shape[0]
    block = _block(rows, X, block)
    blocks = -(-rows // block) + X
    padded = (sizes_X + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    start, padded_start = jnp.cumsum(sizes_X) - sizes_X, padded_end - padded
    group = jnp.repeat(jnp.arange(X, dtype=jnp.int32), sizes_X, total_repeat_length=rows)
    slots = padded_start[group] + jnp.arange(rows, dtype=sizes_X.dtype) - start[group]
    block_groups = jnp.searchsorted(padded_end, jnp.arange(blocks, dtype=padded_end.dtype) * block, side="right")
    return GroupPlan(sizes_X, slots, jnp.minimum(block_groups, X - 1).astype(jnp.int32), block)


def dot(p: GroupPlan, x_MA: jax.Array, w_XAB: jax.Array) -> jax.Array:
    """(M, B): row r of group g times ``w_XAB[g]``."""
    if not p.block:
        return jax.lax.ragged_dot(x_MA, w_XAB, p.sizes)
    return _blocked(x_MA, w_XAB, p.slots, p.block_groups, p.block)


def _padded(rows_MA: jax.Array, slots: jax.Array, blocks: int, block: int, anchor: jax.Array) -> jax.Array:
    """(blocks, block, A): each row at its padded slot, zeros elsewhere. The zeros are made from ``anchor``: a plain
    zeros buffer depends on nothing, and XLA creates every layer's at the program's start (all alive at once)."""
    zeros = after(jnp.zeros((blocks * block, rows_MA.shape[1]), rows_MA.dtype), anchor)
    return zeros.at[slots].set(rows_MA, unique_indices=True).reshape(blocks, block, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked(x_MA, w_XAB, slots, block_groups, block):
    y = jnp.einsum("nra,nab->nrb", _padded(x_MA, slots, block_groups.shape[0], block, x_MA), w_XAB[block_groups],
                   preferred_element_type=x_MA.dtype)
    return y.reshape(-1, y.shape[-1])[slots]


def _blocked_forward(x_MA, w_XAB, slots, block_groups, block):
    return _blocked(x_MA, w_XAB, slots, block_groups, block), (x_MA, w_XAB, slots, block_groups)


def _blocked_backward(block, saved, g_MB):
    """The gradients written out, so that every buffer they fill is made after the incoming gradient (XLA's own
    transposes of the gathers scatter into plain zeros, which it creates at the program's start for every layer)."""
    x_MA, w_XAB, slots, block_groups = saved
    blocks = block_groups.shape[0]
    g_padded = _padded(g_MB, slots, blocks, block, g_MB)
    dx = jnp.einsum("nrb,nab->nra", g_padded, w_XAB[block_groups], preferred_element_type=x_MA.dtype)
    dw_blocks = jnp.einsum("nra,nrb->nab", _padded(x_MA, slots, blocks, block, g_MB), g_padded,
                           preferred_element_type=w_XAB.dtype)
    dw = after(jnp.zeros(w_XAB.shape, w_XAB.dtype), g_MB).at[block_groups].add(dw_blocks)
    return dx.reshape(-1, x_MA.shape[1])[slots], dw, None, None


_blocked.defvjp(_blocked_forward, _blocked_backward)
