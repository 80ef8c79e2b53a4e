"""Prompt prefill in length-sorted row groups and right-aligned chunks: short prompts skip the padding of long ones.

Each shard sorts its prompts by length (longest first) and cuts them into
groups of G rows; group g of every shard forms one forward batch of
shards x G rows. A group runs over the prompt axis in chunks of C tokens,
aligned to the right end of the left-padded prompts, starting at the first
chunk that holds a token of its longest prompt. A single (B, P) forward would
make every prompt pay for the longest one; here a group of short prompts
skips the leading chunks of pure padding, and sorting makes the prompts of a
group alike in length.

The KV cache and last-position logits stay in group-major order, (group,
shards x G rows, ...): the rows of a shard's prompts stay on that shard, and a
prompt's entry is found from its rank in its shard's order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from rlhf_jax.models.decoder import positions_from_mask
from rlhf_jax.models.moe import tokens_on
from rlhf_jax.rollout.buckets import next_power_of_two
from rlhf_jax.rollout.shards import BatchShards

MIN_CHUNK = 16
# Rows x chunk tokens of one prefill forward: below a few hundred the weight matmuls run inefficiently.
PREFILL_TOKENS = 256


@struct.dataclass
class PromptCache:
    """Every prompt's KV and next-token logits, in group-major order; ``rank`` locates a prompt in it."""

    kv: list  # per layer: keys (groups, shards * G, K, D, P), values (groups, shards * G, K, P, D)
    logits: jax.Array  # (groups, shards * G, V) float32: logits of the token after each prompt
    rank: jax.Array  # (B,) int32: the prompt's place in its shard's length order; group rank // G, row rank % G
    mask: jax.Array  # (B, P) int32: the prompt masks, in the original order
    group_size: int = struct.field(pytree_node=False)
    # (groups, shards * G, P, sparse layers, K) int32: each prompt token's expert ids (-1 on padding), or None
    routes: jax.Array | None = None

    def specs(self, shards: BatchShards) -> "PromptCache":
        routes = None if self.routes is None else shards.rows(5, at=1)
        return PromptCache(shards.cache(len(self.kv), at=1), shards.rows(3, at=1), shards.rows(1), shards.rows(2),
                           self.group_size, routes)


def chunk_size(prompt_len: int) -> int:
    """Chunk of the prompt axis: about an eighth of the bucket, at least ``MIN_CHUNK`` (or the whole prompt)."""
    if prompt_len <= MIN_CHUNK:
        return prompt_len
    return max(MIN_CHUNK, next_power_of_two(prompt_len) // 8)


def group_size(prompts_per_shard: int, chunk: int) -> int:
    """Rows per shard in one prefill forward: the largest divisor of the shard's prompts within the token budget."""
    limit = max(1, PREFILL_TOKENS // chunk)
    return max(g for g in range(1, min(prompts_per_shard, limit) + 1) if prompts_per_shard % g == 0)


def _sort_into_groups(ids_BP, mask_BP, *, groups: int):
    """Shard-local: prompts sorted longest first and cut into groups; each prompt's rank in that order."""
    order = jnp.argsort(-jnp.sum(mask_BP, axis=1), stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    grouped = lambda x: x[order].reshape(groups, -1, x.shape[1])  # noqa: E731
    return grouped(ids_BP), grouped(mask_BP), rank.astype(jnp.int32)


def empty_routes(model, rows: int, length: int) -> jax.Array:
    """(rows, length, sparse layers, K) int32 of -1: no token routed yet."""
    cfg = model.config
    return jnp.full((rows, length, sum(cfg.sparse_layers), cfg.num_experts_per_tok), -1, jnp.int32)


def _prefill_group(model, ids, mask, chunk: int, record_routes: bool = False):
    """One group's KV (rows, P), the hidden state of each prompt's last token and, with ``record_routes``, every
    prompt token's expert ids (rows, P, sparse layers, K) (else None), chunk by chunk."""
    rows, P = ids.shape
    num_chunks = -(-P // chunk)
    longest = jnp.max(jnp.sum(mask, axis=1))
    positions = positions_from_mask(mask)

    def body(carry):
        index, cache, _, routes = carry
        # right-aligned chunks; the first one is clamped to 0 and may overlap the second, which rewrites
        # the same keys and values (and routes)
        start = jnp.maximum(P - (num_chunks - index) * chunk, 0)
        piece = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1)  # noqa: E731
        out = model.forward_cached(piece(ids), piece(positions), mask, cache, start, record_routes=record_routes)
        if record_routes:
            routes = jax.lax.dynamic_update_slice_in_dim(routes, out[2], start, axis=1)
        return index + 1, out[1], out[0][:, -1], routes

    first = num_chunks - (longest + chunk - 1) // chunk
    last = jnp.zeros((rows, model.config.hidden_size), model.config.dtype)
    routes = empty_routes(model, rows, P) if record_routes else None
    _, cache, last, routes = jax.lax.while_loop(lambda c: c[0] < num_chunks, body,
                                                (first, model.init_cache(rows, P), last, routes))
    if record_routes:
        routes = jnp.where(mask[:, :, None, None] > 0, routes, -1)
    return cache, last, routes


def prefill_prompts(model, ids_BP: jax.Array, mask_BP: jax.Array, shards: BatchShards,
                    record_routes: bool = False) -> PromptCache:
    """KV cache and next-token logits of left-padded prompts (B, P), each prompt computed once; with
    ``record_routes`` also every prompt token's expert ids."""
    B, P = ids_BP.shape
    chunk = chunk_size(P)
    G = group_size(shards.per_shard(B, "prompts"), chunk)
    groups = B // shards.count // G
    grouped_spec = shards.rows(3, at=1)
    plan = shards.local(functools.partial(_sort_into_groups, groups=groups),
                        (shards.rows(2), shards.rows(2)), (grouped_spec, grouped_spec, shards.rows(1)))
    ids_g, mask_g, rank = plan(ids_BP, mask_BP)

    cfg = model.config
    rows = shards.count * G
    kv_specs = shards.cache(cfg.num_hidden_layers, at=1)
    kv = [(jnp.zeros((groups,) + k.shape, k.dtype), jnp.zeros((groups,) + v.shape, v.dtype))
          for k, v in model.init_cache(rows, P)]
    kv = shards.constrain(kv, kv_specs)
    logits = jnp.zeros((groups, rows, cfg.vocab_size), jnp.float32)
    routes = jnp.stack([empty_routes(model, rows, P)] * groups) if record_routes else None

    def one_group(g, carry):
        kv, logits, routes = carry
        with tokens_on(shards.mesh, shards.batch, shards.rules):  # a group's rows lie over the shards
            cache, last, group_routes = _prefill_group(model, ids_g[g], mask_g[g], chunk, record_routes)
        kv = [(jax.lax.dynamic_update_index_in_dim(kb, k, g, 0), jax.lax.dynamic_update_index_in_dim(vb, v, g, 0))
              for (kb, vb), (k, v) in zip(kv, cache)]
        next_logits = model.logits_from_hidden(last[:, None, :])[:, 0, :]
        if record_routes:
            routes = shards.constrain(jax.lax.dynamic_update_index_in_dim(routes, group_routes, g, 0),
                                      shards.rows(5, at=1))
        return (shards.constrain(kv, kv_specs), jax.lax.dynamic_update_index_in_dim(logits, next_logits, g, 0),
                routes)

    kv, logits, routes = jax.lax.fori_loop(0, groups, one_group, (kv, logits, routes))
    logits = shards.constrain(logits, grouped_spec)
    return PromptCache(kv=kv, logits=logits, rank=rank, mask=mask_BP.astype(jnp.int32), group_size=G, routes=routes)
