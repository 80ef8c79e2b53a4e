"""An upper bound, from the model's arithmetic, on what one training pass adds to a device's memory.

The memory plan compiles every pass to read XLA's estimate; for a pass that cannot come near the memory
the device has free, that compile (tracing, lowering, XLA) buys nothing: the plan would keep the size it
started from. A small model on a large host, or on an accelerator, is that case, and there the compile
is a large part of starting a run. So the plan first asks this bound, and compiles only when the bound
reaches a tenth of the usable memory (``SKIP_FRACTION``).

The bound must never be below XLA's estimate, so it counts everything unsharded, in float32, as if
nothing were freed or recomputed: every layer's inputs, projections, MLP and attention scores kept for
the backward pass (Mixture-of-Experts layers as if every routed token met every expert), the whole logits list with its softmax and gradient, the micro-batch's arrays, and
for a gradient pass four copies of the trained parameters (gradients, accumulator, temporaries).
Real passes shard, chunk the logits and recompute layers, so they need far less.
"""

from __future__ import annotations

import jax

SKIP_FRACTION = 0.1  # compile a pass only when its bound reaches this fraction of the usable memory
_F32 = 4
_BATCH_ARRAYS = 24  # per-token arrays a pass takes or makes beside activations (ids, masks, advantages, ...)


def tree_bytes(tree) -> int:
    """Bytes of every array of ``tree`` whole (unsharded), real or abstract."""
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree) if hasattr(leaf, "dtype"))


def pass_bound_bytes(model_config, *, rows: int, row_len: int, batch_rows: int, trained_bytes: int = 0) -> int:
    """At most what a pass over micro-batches of ``rows`` rows of ``row_len`` tokens, of a batch of ``batch_rows``
    such rows, adds on one device (see the module doc); ``trained_bytes``: the parameters a gradient pass trains
    (0 for a forward pass)."""
    c = model_config
    tokens = rows * row_len
    heads = c.num_attention_heads
    qkv = (heads + 2 * c.num_key_value_heads) * c.head_dim
    mlp = max(c.intermediate_size, c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size)
    per_layer = tokens * (8 * c.hidden_size + 2 * qkv + 2 * heads * c.head_dim + 4 * mlp)
    # grouped expert products may be lowered densely (every routed pair against every expert) where no
    # grouped-matmul kernel exists, as on CPU, and so may their gradients
    per_layer += 3 * tokens * c.num_experts_per_tok * c.num_experts * (c.hidden_size + c.moe_intermediate_size)
    scores = 3 * rows * heads * row_len * row_len  # scores, probabilities, their gradient
    logits = 4 * tokens * max(c.vocab_size, c.num_labels)  # logits, log-softmax, probabilities, gradient
    activations = c.num_hidden_layers * (per_layer + scores) + logits + _BATCH_ARRAYS * max(rows, batch_rows) * row_len
    return _F32 * activations + 4 * trained_bytes


def role_pass_bound(plan, role, gradient: bool) -> int:
    """``pass_bound_bytes`` of a memory plan's pass (``train.passes.PassPlan``) run by ``role``; ``gradient``: an
    update, which trains the role's parameters."""
    return pass_bound_bytes(role.config, rows=plan.rows_per_micro, row_len=plan.row_len, batch_rows=plan.seqs_per_shard,
                            trained_bytes=tree_bytes(role.params) if gradient else 0)


def needs_compile(bound: int, free: int | None, headroom: float) -> bool:
    """Whether the plan must compile a pass whose bound is ``bound`` to know that it fits ``free`` bytes."""
    return free is None or bound > SKIP_FRACTION * headroom * free
