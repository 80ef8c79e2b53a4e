"""Prefill + continuous-batching decode in one traced function: n samples per prompt, outputs by sample id.

1. Prefill (``prefill.py``): every prompt once, in length-sorted groups and chunks.
2. Each sample's first token is drawn from its prompt's logits; samples that
   it does not end wait in their shard's queue.
3. Decode (``scheduler.py``): M slots in a ``lax.while_loop``, one token per
   slot per step; a slot whose sample ends takes the next pending sample of
   its shard inside the same loop. When the queues are empty and few enough
   slots are live, the live ones move into a loop compiled for fewer slots.

Under a context split (``mesh.context`` > 1) every slot's cache is split along its length over the context axis
(``shards.BatchShards``): the decode step's attention reduces over the split columns (XLA all-reduces the softmax's
max and sum and the weighted values, per token), its cache is rounded up to whole blocks and starts at full width.

Every token lands in (N, R) buffers at (sample id, token index), so the result
is the same prompt-major ``RolloutBatch`` whatever the slot count. A token is
drawn with the key of (call key, sample id, token index): which slot a sample
ran in, or when, does not change it.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from rlhf_jax.models.kernel_layout import kernel_layout
from rlhf_jax.models.moe import tokens_on
from rlhf_jax.parallel.mesh import DEFAULT_RULES, Rules, single_device_mesh
from rlhf_jax.rollout import scheduler
from rlhf_jax.rollout.params import SamplingParams
from rlhf_jax.rollout.prefill import empty_routes, prefill_prompts
from rlhf_jax.rollout.sampling import row_keys, sample_in_row_chunks, sample_keys
from rlhf_jax.rollout.scheduler import Responses
from rlhf_jax.rollout.shards import BatchShards
from rlhf_jax.types import RolloutBatch


@struct.dataclass
class DecodeStats:
    """What the decode loops executed: ``steps[i]`` steps of ``slots[i]`` slots each."""

    steps: jax.Array  # (phases,) int32
    slots: tuple[int, ...] = struct.field(pytree_node=False)

    def slot_steps(self) -> int:
        """Decode steps x slots, summed over the loops (host value)."""
        return int(sum(int(s) * m for s, m in zip(jax.device_get(self.steps), self.slots)))


# Rows per sampling chunk on CPU (see ``sample_in_row_chunks``); other platforms sample all rows at once.
CPU_SAMPLE_ROWS = 16


def _draw(logits, keys, step, params: SamplingParams, shards: BatchShards):
    """Each row's next token and log-prob, sampled on the row's shard; ``step`` (rows,) is each row's token index."""
    rows = CPU_SAMPLE_ROWS if shards.platform == "cpu" else logits.shape[0]
    fn = functools.partial(sample_in_row_chunks, params=params, rows=rows)
    r1 = shards.rows(1)
    return shards.local(fn, (shards.rows(2), r1, r1), (r1, r1))(logits, keys, step)


def _first_tokens(model, prompts, key, params: SamplingParams, shards: BatchShards):
    """Token 0 of every sample, from its prompt's logits; buffers and queue start from it."""
    n, R = params.n, params.max_new_tokens
    N = prompts.rank.shape[0] * n
    logits = scheduler.first_token_logits(prompts, n, shards)
    tokens, logps = _draw(logits, row_keys(key, N), jnp.zeros((N,), jnp.int32), params, shards)
    stop = scheduler.is_stop(tokens, () if params.ignore_eos else params.eos_token_ids)
    responses = Responses(
        tokens=jnp.full((N, R), params.pad_token_id, jnp.int32).at[:, 0].set(tokens),
        mask=jnp.zeros((N, R), jnp.int32).at[:, 0].set(1),
        logprobs=jnp.zeros((N, R), jnp.float32).at[:, 0].set(logps),
        finished=stop,
        routes=empty_routes(model, N, R) if params.record_routes else None,
    )
    responses = shards.constrain(responses, responses.specs(shards))
    pending = ~stop & (R > 1)
    return tokens, responses, scheduler.start_queue(pending, shards)


def _decode(model, slots, queue, responses, prompts, first_token, key, params, shards, phases):
    """The decode loops, one per slot count in ``phases`` (the first one possibly preceded by a loop on a narrower
    cache); returns the responses, the steps per loop and the slot count of each loop."""
    n, R = params.n, params.max_new_tokens
    P = slots.prompt_mask.shape[1]
    S = shards.cache_width(P + R - 1)
    samples_per_shard = responses.finished.shape[0] // shards.count
    stop_ids = () if params.ignore_eos else params.eos_token_ids

    def step(carry):
        slots, queue, responses, steps = carry
        width = slots.cache[0][0].shape[3]
        slots, queue = scheduler.prepare(slots, queue, prompts, first_token, n, shards)
        # the decode kernels may run, per device, on a cache whose columns each device holds whole; a cache split
        # over the context axis takes XLA's multiply-reduce, whose softmax and value sums XLA combines across it
        layout = kernel_layout(shards.mesh, shards.batch, shards.kv_heads) if shards.length_ways == 1 else nullcontext()
        with layout, tokens_on(shards.mesh, shards.batch, shards.rules):
            out = model.forward_cached(slots.last[:, None], slots.positions()[:, None],
                                       slots.key_valid(), slots.cache, width - 1, record_routes=params.record_routes)
        hidden, cache = out[:2]
        routes = out[2][:, 0] if params.record_routes else None  # the fed-back token's (M, sparse layers, K)
        logits = shards.constrain(model.logits_from_hidden(hidden)[:, 0, :], shards.rows(2))
        keys = sample_keys(key, scheduler.global_sample_ids(slots, samples_per_shard, shards))
        tokens, logps = _draw(logits, keys, slots.t, params, shards)
        slots, responses = scheduler.record(slots.replace(cache=cache), responses, tokens, logps, stop_ids, shards,
                                            routes)
        return slots, queue, responses, steps + 1

    def running(next_size: int | None, width: int | None = None):
        def cond(carry):
            slots, queue, _, _ = carry
            busy = jnp.any(slots.sample >= 0) | jnp.any(queue.head < queue.count)
            if next_size is not None:
                busy &= ~scheduler.can_shrink(slots, queue, next_size, shards)
            return busy if width is None else busy & scheduler.fits(slots, width)
        return cond

    steps, sizes = [], []
    for i, size in enumerate(phases):
        if i:
            slots = scheduler.shrink(slots, size, shards)
        next_size = phases[i + 1] if i + 1 < len(phases) else None
        width = slots.cache[0][0].shape[3]
        if width < S:  # the narrow first loop, then the same slots on the whole cache
            slots, queue, responses, count = jax.lax.while_loop(
                running(next_size, width), step, (slots, queue, responses, jnp.int32(0)))
            steps.append(count)
            sizes.append(size)
            slots = scheduler.widen(slots, S, shards)
        slots, queue, responses, count = jax.lax.while_loop(
            running(next_size), step, (slots, queue, responses, jnp.int32(0)))
        steps.append(count)
        sizes.append(size)
    return responses, jnp.stack(steps), tuple(sizes)


def rollout_with_stats(
    model,
    prompt_ids_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    key: jax.Array,
    params: SamplingParams,
    *,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
) -> tuple[RolloutBatch, DecodeStats]:
    """``rollout`` and what its decode loops executed."""
    B, P = prompt_ids_BP.shape
    n, R = params.n, params.max_new_tokens
    shards = BatchShards(mesh if mesh is not None else single_device_mesh(), rules, model.config.num_key_value_heads)
    ids = prompt_ids_BP.astype(jnp.int32)
    mask = prompt_mask_BP.astype(jnp.int32)
    prompts = prefill_prompts(model, ids, mask, shards, params.record_routes)
    first_token, responses, queue = _first_tokens(model, prompts, key, params, shards)

    slots = scheduler.num_slots(B * n, shards.count, params.max_num_seqs)
    phases = scheduler.phase_sizes(slots, shards.count, R) if R > 1 else ()
    loops: tuple[int, ...] = ()
    if phases:
        # under a context split the cache starts whole: widening a split cache would move most columns to
        # another device
        narrow = scheduler.narrow_width(P, R) if shards.length_ways == 1 else None
        width = shards.cache_width(narrow or P + R - 1)
        state = scheduler.empty_slots(model, slots, P, width, shards)
        responses, steps, loops = _decode(model, state, queue, responses, prompts, first_token, key, params, shards,
                                          phases)
    else:
        steps = jnp.zeros((0,), jnp.int32)
    batch = RolloutBatch(
        prompts=jnp.repeat(ids, n, axis=0),
        prompt_mask=jnp.repeat(mask, n, axis=0),
        responses=responses.tokens,
        response_mask=responses.mask,
        logprobs=responses.logprobs,
        finished=responses.finished,
        routed_experts=scheduler.sample_routes(prompts, responses, n, shards) if params.record_routes else None,
    )
    return batch, DecodeStats(steps=steps, slots=loops)


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
    return rollout_with_stats(model, prompt_ids_BP, prompt_mask_BP, key, params, mesh=mesh, rules=rules)[0]
