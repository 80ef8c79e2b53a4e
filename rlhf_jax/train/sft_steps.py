"""Pure SFT step functions: the token-mean cross-entropy of trained response tokens and its optimizer step.

Padded rows (``sft_update``) or packed ones (``packed_sft_grads``, one packed micro-batch at a time: its
log-probs are scattered into the batch's (rows, R) grid, see ``packed_steps``). A batch holds ``input_ids`` /
``attention_mask`` (N, P + R) (left-padded prompt, right-padded response),
``responses`` (N, R) and ``response_mask`` (N, R): the response tokens that are trained (an assistant message's
tokens; holes at the user turns of a conversation). The loss is the sum of the trained tokens' negative
log-likelihoods divided by the number of trained tokens of the *whole* global batch, computed once and passed to
every micro-batch: gradient accumulation then gives exactly the gradient of the batch's token mean, whatever
the micro-batch size or the number of data-parallel shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlhf_jax.train.packed_steps import covered_mask, packed_log_probs, scatter_to_grid
from rlhf_jax.train.steps import apply_update, response_log_probs, split_micro
from rlhf_jax.types import TrainBatch

LOSS = "train/loss"


def nll_sum(logp, loss_mask):
    """Sum of the negative log-likelihoods of the trained tokens (float32)."""
    return -jnp.sum(logp * loss_mask.astype(jnp.float32))


def sft_update(graphdef, tx, spec, params, frozen, opt_state, mb: TrainBatch, *, n_micro: int):
    """One optimizer step on the batch ``mb``, accumulating gradients over ``n_micro`` micro-batches.

    ``spec`` is unused (the loss has no settings); it keeps the signature of the other update steps."""
    del spec
    tokens = jnp.maximum(jnp.sum(mb.response_mask.astype(jnp.float32)), 1.0)
    micro = split_micro(mb, n_micro)

    def micro_step(grad_acc, m):
        def loss_fn(p):
            model = nnx.merge(graphdef, p, frozen)
            logp, _ = response_log_probs(model, m.input_ids, m.attention_mask, m.responses, 1.0, False)
            return nll_sum(logp, m.response_mask) / tokens

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(jnp.add, grad_acc, grads), loss

    grads, losses = jax.lax.scan(micro_step, jax.tree.map(jnp.zeros_like, params), micro)
    params, opt_state, grad_norm = apply_update(tx, params, opt_state, grads)
    return params, opt_state, {LOSS: jnp.sum(losses), "train/grad_norm": grad_norm, "train/loss_tokens": tokens}


def packed_sft_grads(graphdef, spec, params, frozen, grad_acc, micro: dict, grid: TrainBatch, *, dp: int):
    """Add one packed micro-batch's SFT gradient into ``grad_acc``; returns (grad_acc, metrics, its trained tokens).

    ``grid`` holds the batch's ``response_mask`` (rows, R), the trained tokens; the denominator is the whole batch's
    trained tokens, so the micro-batches' losses and gradients add up to the batch's."""
    del spec
    mask = grid.response_mask.astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    m_mask = mask * covered_mask(micro, mask.shape, dp)

    def loss_fn(p):
        model = nnx.merge(graphdef, p, frozen)
        logp_c, _ = packed_log_probs(model, micro, 1.0, False, dp)
        loss = nll_sum(scatter_to_grid(logp_c, micro["logit_targets"], mask.shape, dp), m_mask) / tokens
        return loss, {LOSS: loss}

    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(jnp.add, grad_acc, grads), aux, jnp.sum(m_mask)
