"""Gradient checkpointing of one decoder layer that saves memory on every XLA backend.

``jax.checkpoint`` alone marks what to recompute, and guards the recomputation
with an optimisation barrier so that XLA does not merge it back into the forward
pass (common-subexpression elimination). XLA:CPU drops those barriers before it
eliminates common subexpressions, so there the recomputation vanishes and the
program keeps every activation, as without remat. Here the backward pass makes
the saved residuals depend on the incoming cotangent (by adding an exact zero
computed from it): the recomputation then has different inputs from the forward
pass, cannot be merged into it, and cannot be scheduled before the cotangent
exists, which is where it belongs.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

POLICIES = {
    # Keep only the layer's inputs.
    "full": jax.checkpoint_policies.nothing_saveable,
    # Also keep the matmuls without batch dimensions (projections, MLP); the attention score
    # matmuls have batch dimensions and would be quadratic in the sequence length.
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def after(tree, anchor):
    """``tree`` with every floating leaf made to depend on ``anchor`` (an array or a pytree whose first leaf is one),
    so XLA cannot compute with it before ``anchor`` exists; values are unchanged (an exact zero is added)."""
    first = jax.tree.leaves(anchor)[0].reshape(-1)[0]  # an array output, or the first (a sparse layer's hidden states)
    zero = jnp.where(jnp.isfinite(first), first * 0, 0)

    def depend(leaf):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf + zero.astype(leaf.dtype)
        return leaf

    return jax.tree.map(depend, tree)


def checkpointed(fn: Callable[..., jax.Array], policy: str) -> Callable[..., jax.Array]:
    """``fn`` (positional array arguments, an array output or a pytree of arrays) recomputed in the backward pass per ``policy``."""
    remat_fn = jax.checkpoint(fn, policy=POLICIES[policy])

    @jax.custom_vjp
    def run(*args):
        return fn(*args)

    def forward(*args):
        return jax.vjp(remat_fn, *args)  # (output, vjp function holding only the saved residuals)

    def backward(vjp_fn, cotangent):
        return after(vjp_fn, cotangent)(cotangent)

    run.defvjp(forward, backward)
    return run
