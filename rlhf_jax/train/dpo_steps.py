"""Pure, jittable DPO step: sequence log-probs of chosen and rejected responses, the pair loss, one update.

A DPO mini-batch is a dict of (B, ...) arrays over B preference pairs, sharded over the batch axes:

- ``chosen_input_ids`` / ``chosen_attention_mask`` (B, P + R): the left-padded prompt followed by the
  right-padded chosen response; ``chosen_responses`` / ``chosen_response_mask`` (B, R); the same for
  ``rejected_*`` (same prompt, other response);
- ``ref_chosen`` / ``ref_rejected`` (B,): the reference's sequence log-probs, computed before the update;
- with a KL loss (``DPOSpec.kl_coef`` > 0) also ``ref_chosen_tokens`` / ``ref_rejected_tokens`` (B, R): the
  reference's per-token log-probs, for the KL estimate of each response token.

This is the RL batch layout (steps.py) twice, so the reference pass is the ordinary log-prob pass. Micro-batches
hold whole pairs (the loss couples a pair's two responses); each micro-batch's loss is its pairs' sum over the
mini-batch's pair count, so accumulation gives the mini-batch's gradient exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from rlhf_jax.algos.dpo import dpo_loss
from rlhf_jax.algos.kl import kl_penalty
from rlhf_jax.train.steps import apply_update, response_log_probs, split_micro
from rlhf_jax.types import TrainBatch

SIDES = ("chosen", "rejected")
METRIC_NAMES = {"loss": "actor/dpo_loss"}  # the rest keep TRL's names (rewards/..., logps/...)


@dataclasses.dataclass(frozen=True)
class DPOSpec:
    """Static settings of the DPO loss (hashable: part of the jit cache key)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"
    kl_coef: float = 0.0  # weight of the per-token KL loss to the reference (Trinity-RFT's DPO adds one)
    kl_type: str = "low_var_kl"


def pair_specs(pairs: int, prompt_len: int, response_len: int,
               kl: bool = False) -> dict[str, tuple[tuple[int, ...], object]]:
    """{key: (shape, dtype)} of a mini-batch of ``pairs`` pairs (the layout above), for compiling the update."""
    P, R = prompt_len, response_len
    specs = {"ref_chosen": ((pairs,), jnp.float32), "ref_rejected": ((pairs,), jnp.float32)}
    if kl:
        specs.update({f"ref_{s}_tokens": ((pairs, R), jnp.float32) for s in SIDES})
    for s in SIDES:
        specs.update({f"{s}_input_ids": ((pairs, P + R), jnp.int32), f"{s}_attention_mask": ((pairs, P + R), jnp.int32),
                      f"{s}_responses": ((pairs, R), jnp.int32), f"{s}_response_mask": ((pairs, R), jnp.int32)})
    return specs


def side(batch: dict, name: str) -> TrainBatch:
    """The RL-layout batch (input_ids, attention_mask, responses, response_mask) of one side of the pairs."""
    fields = ("input_ids", "attention_mask", "responses", "response_mask")
    return TrainBatch(**{k: batch[f"{name}_{k}"] for k in fields})


def sequence_log_probs(model, b: TrainBatch):
    """Summed log-probs of each row's response tokens (b,), float32 (the quantity DPO compares)."""
    return jnp.sum(token_log_probs(model, b) * b.response_mask.astype(jnp.float32), axis=-1)


def token_log_probs(model, b: TrainBatch):
    """Log-probs of each row's response tokens (b, R), float32."""
    logp, _ = response_log_probs(model, b.input_ids, b.attention_mask, b.responses, 1.0, False)
    return logp.astype(jnp.float32)


def dpo_update(graphdef, tx, spec: DPOSpec, params, frozen, opt_state, mb: dict, *, n_micro: int):
    """One optimizer step on one mini-batch of pairs, accumulating gradients over ``n_micro`` micro-batches."""
    pairs = mb["ref_chosen"].shape[0]
    # the KL loss is a token mean over the whole mini-batch: each micro-batch adds its share of it
    tokens = jnp.maximum(sum(jnp.sum(mb[f"{s}_response_mask"]) for s in SIDES).astype(jnp.float32), 1.0)
    micro = split_micro(mb, n_micro)

    def micro_step(grad_acc, m):
        def loss_fn(p):
            model = nnx.merge(graphdef, p, frozen)
            logps = {s: token_log_probs(model, side(m, s)) for s in SIDES}
            masks = {s: m[f"{s}_response_mask"].astype(jnp.float32) for s in SIDES}
            chosen, rejected = (jnp.sum(logps[s] * masks[s], axis=-1) for s in SIDES)
            loss, aux = dpo_loss(chosen, rejected, m["ref_chosen"], m["ref_rejected"], beta=spec.beta,
                                 label_smoothing=spec.label_smoothing, loss_type=spec.loss_type,
                                 denominator=jnp.float32(pairs))
            if spec.kl_coef > 0:
                kl = sum(jnp.sum(kl_penalty(logps[s], m[f"ref_{s}_tokens"], spec.kl_type) * masks[s])
                         for s in SIDES) / tokens
                loss = loss + spec.kl_coef * kl
                aux = {**aux, "actor/kl_loss": jax.lax.stop_gradient(kl)}
            return loss, aux

        (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return jax.tree.map(jnp.add, grad_acc, grads), aux

    grads, aux = jax.lax.scan(micro_step, jax.tree.map(jnp.zeros_like, params), micro)
    params, opt_state, grad_norm = apply_update(tx, params, opt_state, grads)
    metrics = {METRIC_NAMES.get(k, k): jnp.sum(v) for k, v in aux.items()}  # each is a share of the mean already
    return params, opt_state, {**metrics, "actor/grad_norm": grad_norm}
