"""Prefill + decode in one traced function: KV cache, shared prompt prefill for n samples, early-exit loop.

Layout of the cache (per layer, keys (N, K, D, S), values (N, K, S, D); N = B * n, S = P + R - 1):
slots [0, P) hold the left-padded prompt, slot P + t - 1 the response token t
once it has been fed back. Each prompt is prefilled once; its cache rows are
repeated n times (prompt-major: the n samples of prompt 0 first) into the
decode cache. The cache lives in the ``lax.while_loop`` carry and is written
with ``dynamic_update_slice``, which XLA performs in place: no copy per step.

Key validity never changes during decoding: prompt slots follow the prompt
mask and response slots are all valid, because a query at slot i only sees
slots j <= i, all of which are written by then. So the mask is built once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding

from rlhf_jax.models.decoder import positions_from_mask
from rlhf_jax.parallel.mesh import DEFAULT_RULES, Rules, logical_to_spec
from rlhf_jax.rollout.params import SamplingParams
from rlhf_jax.rollout.sampling import row_keys, sample_step


@struct.dataclass
class RolloutBatch:
    """Sampled responses, N = B * n rows in prompt-major order; all arrays sharded over the batch."""

    prompts: jax.Array  # (N, P) int32, left-padded with the pad id
    prompt_mask: jax.Array  # (N, P) int32
    responses: jax.Array  # (N, R) int32, pad id after the end
    response_mask: jax.Array  # (N, R) int32: 1 up to and including EOS, 0 after
    logprobs: jax.Array  # (N, R) float32: log_softmax(logits / temperature) of each sampled token, 0 where masked
    finished: jax.Array  # (N,) bool: the response ended with an EOS token (not cut at R)

    def input_ids(self) -> jax.Array:
        """Prompt and response side by side (N, P + R): the sequence a trainer scores."""
        return jnp.concatenate([self.prompts, self.responses], axis=1)

    def attention_mask(self) -> jax.Array:
        return jnp.concatenate([self.prompt_mask, self.response_mask], axis=1)

    def response_lengths(self) -> jax.Array:
        return jnp.sum(self.response_mask, axis=1)


def _constrain(x: jax.Array, mesh: Mesh | None, axes: tuple, rules: Rules) -> jax.Array:
    if mesh is None:
        return x
    spec = logical_to_spec(axes, rules, mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def prefill(model, prompt_ids_BP: jax.Array, prompt_mask_BP: jax.Array):
    """One forward over the left-padded prompts into a (B, P) cache; logits of the last position only."""
    B, P = prompt_ids_BP.shape
    cache = model.init_cache(B, P)
    positions = positions_from_mask(prompt_mask_BP)
    hidden, cache = model.forward_cached(prompt_ids_BP, positions, prompt_mask_BP, cache, 0)
    return model.logits_from_hidden(hidden[:, -1:, :])[:, 0, :], cache


def expand_cache(cache, n: int, total_slots: int, mesh: Mesh | None, rules: Rules):
    """Repeat each prompt's cache rows n times into a zero-initialised (B * n, total_slots) cache."""
    out = []
    for k, v in cache:  # k (B, K, D, P), v (B, K, P, D): the slot axis is 3 for keys, 2 for values
        pair = []
        for x, slot_axis, axes in ((k, 3, ("batch", "kv_heads", "head_dim", "length")),
                                   (v, 2, ("batch", "kv_heads", "length", "head_dim"))):
            shape = list(x.shape)
            shape[0], shape[slot_axis] = shape[0] * n, total_slots
            full = jnp.zeros(tuple(shape), x.dtype)
            full = jax.lax.dynamic_update_slice_in_dim(full, jnp.repeat(x, n, axis=0), 0, axis=slot_axis)
            pair.append(_constrain(full, mesh, axes, rules))
        out.append(tuple(pair))
    return out


def _is_eos(tokens_N: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    hit = jnp.zeros(tokens_N.shape, bool)
    for e in eos_ids:
        hit = hit | (tokens_N == e)
    return hit


def rollout(
    model,
    prompt_ids_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    key: jax.Array,
    params: SamplingParams,
    *,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
) -> RolloutBatch:
    """Sample ``params.n`` responses of up to ``params.max_new_tokens`` tokens per prompt (traceable)."""
    B, P = prompt_ids_BP.shape
    n, R, pad = params.n, params.max_new_tokens, params.pad_token_id
    N, S = B * n, P + R - 1
    stop_ids = () if params.ignore_eos else params.eos_token_ids
    mask_BP = prompt_mask_BP.astype(jnp.int32)

    logits_BV, prompt_cache = prefill(model, prompt_ids_BP.astype(jnp.int32), mask_BP)
    logits_NV = _constrain(jnp.repeat(logits_BV, n, axis=0), mesh, ("batch", None), rules)
    cache = expand_cache(prompt_cache, n, S, mesh, rules)
    mask_NP = jnp.repeat(mask_BP, n, axis=0)
    prompt_len_N = jnp.sum(mask_NP, axis=1)
    key_valid_NS = jnp.concatenate([mask_NP, jnp.ones((N, S - P), jnp.int32)], axis=1)
    keys_N = row_keys(key, N)

    def record(state, t, tokens, logps):
        responses, response_mask, logprobs, finished = state
        live = ~finished
        tokens = jnp.where(live, tokens, pad)
        responses = jax.lax.dynamic_update_slice_in_dim(responses, tokens[:, None], t, axis=1)
        response_mask = jax.lax.dynamic_update_slice_in_dim(response_mask, live.astype(jnp.int32)[:, None], t, axis=1)
        logprobs = jax.lax.dynamic_update_slice_in_dim(logprobs, jnp.where(live, logps, 0.0)[:, None], t, axis=1)
        finished = finished | (live & _is_eos(tokens, stop_ids))
        return tokens, (responses, response_mask, logprobs, finished)

    batch_axes = ("batch", None)
    outputs = (
        _constrain(jnp.full((N, R), pad, jnp.int32), mesh, batch_axes, rules),
        _constrain(jnp.zeros((N, R), jnp.int32), mesh, batch_axes, rules),
        _constrain(jnp.zeros((N, R), jnp.float32), mesh, batch_axes, rules),
        jnp.zeros((N,), bool),
    )
    tokens, logps = sample_step(logits_NV, keys_N, 0, params)
    last, outputs = record(outputs, 0, tokens, logps)

    def cond(carry):
        t, _, _, outputs = carry
        return (t < R) & ~jnp.all(outputs[3])

    def body(carry):
        t, last, cache, outputs = carry
        hidden, cache = model.forward_cached(last[:, None], (prompt_len_N + t - 1)[:, None], key_valid_NS, cache, P + t - 1)
        logits = _constrain(model.logits_from_hidden(hidden)[:, 0, :], mesh, ("batch", None), rules)
        tokens, logps = sample_step(logits, keys_N, t, params)
        last, outputs = record(outputs, t, tokens, logps)
        return t + 1, last, cache, outputs

    _, _, _, outputs = jax.lax.while_loop(cond, body, (jnp.int32(1), last, cache, outputs))
    responses, response_mask, logprobs, finished = outputs
    return RolloutBatch(
        prompts=jnp.repeat(prompt_ids_BP.astype(jnp.int32), n, axis=0),
        prompt_mask=mask_NP,
        responses=responses,
        response_mask=response_mask,
        logprobs=logprobs,
        finished=finished,
    )
