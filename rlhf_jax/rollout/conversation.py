"""Conversations that continue on the device: each row's KV cache is kept between turns, a turn prefills only its
new tokens, then decodes until a stop token, a stop sequence or the row's token limit.

Cache layout, per row and layer: keys (K, D, W), values (K, W, D). Columns [0, length) hold the conversation so
far, contiguous, so a token's position is its column. ``append`` adds T new tokens to every row at once: the
model writes one index range for all rows, so the T tokens go to the last T columns (staging, right-padded per
row and masked), where each query sees its row's conversation and the staged tokens before it; the staged block
is then copied to each row's own columns [length, length + T). Rows append different numbers of tokens; a row
that appends none keeps its state (what lands past its length is never read: key validity is ``< length``).

Capacity: a row holds at most ``capacity`` tokens and the staging block is at most ``stage`` wide, so W =
capacity + stage and neither the copy nor the staging ever overwrites a row's conversation.

A sliding-window layer measures distances in cache columns, which differ from positions for the staged tokens,
so models whose window is shorter than W are refused (``check_model``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from rlhf_jax.rollout.params import SamplingParams
from rlhf_jax.rollout.prefill import empty_routes
from rlhf_jax.rollout.sampling import sample_in_row_chunks, sample_keys
from rlhf_jax.rollout.shards import BatchShards

# Rows per sampling chunk on CPU (as the decode loop samples).
CPU_SAMPLE_ROWS = 16


@struct.dataclass
class Conversations:
    """Per-row conversation state on the device; every array's leading axis is the row."""

    kv: list  # per layer (keys (B, K, D, W), values (B, K, W, D))
    length: jax.Array  # (B,) int32 tokens held
    logits: jax.Array  # (B, V) float32 next-token logits after each row's last token
    # (B, W, sparse layers, K) int32: the experts each column's token was routed to, -1 where none (router replay
    # R3 records them); None when not recorded
    routes: jax.Array | None = None

    def specs(self, shards: BatchShards) -> "Conversations":
        return Conversations(shards.cache(len(self.kv)), shards.rows(1), shards.rows(2),
                             None if self.routes is None else shards.rows(4))


@struct.dataclass
class TurnOutput:
    """One decoded turn, (B, L) buffers of the tokens each row drew this turn."""

    tokens: jax.Array  # (B, L) int32
    logprobs: jax.Array  # (B, L) float32
    count: jax.Array  # (B,) int32 tokens drawn this turn
    stopped: jax.Array  # (B,) bool: the turn ended with a stop token or a stop sequence (not at its limit)


def check_model(cfg, width: int) -> None:
    """Refuse layers whose sliding window is shorter than the cache (their distances would count staging columns)."""
    windows = [cfg.window_of(i) for i in range(cfg.num_hidden_layers)]
    short = [w for w in windows if w is not None and w < width]
    if short:
        raise ValueError(f"multi-turn rollouts need full attention over {width} cache columns; this model has a "
                         f"sliding window of {min(short)} tokens (lower rollout.response_length / the prompt length "
                         f"below it or use a model without sliding windows)")


def empty(model, rows: int, capacity: int, stage: int, shards: BatchShards,
          record_routes: bool = False) -> Conversations:
    kv = shards.constrain(model.init_cache(rows, capacity + stage), shards.cache(model.config.num_hidden_layers))
    routes = shards.constrain(empty_routes(model, rows, capacity + stage), shards.rows(4)) if record_routes else None
    return Conversations(kv=kv, length=jnp.zeros((rows,), jnp.int32),
                         logits=jnp.zeros((rows, model.config.vocab_size), jnp.float32), routes=routes)


def _commit_local(kv: list, length: jax.Array, width: int) -> list:
    """Each row's staged block (the last ``width`` columns) copied to its columns [length, length + width)."""
    def row_k(k, start):
        return jax.lax.dynamic_update_slice_in_dim(k, k[..., -width:], start, axis=2)

    def row_v(v, start):
        return jax.lax.dynamic_update_slice_in_dim(v, v[:, -width:, :], start, axis=1)

    return [(jax.vmap(row_k)(k, length), jax.vmap(row_v)(v, length)) for k, v in kv]


def append(model, conv: Conversations, ids_BT: jax.Array, count_B: jax.Array, shards: BatchShards) -> Conversations:
    """Append ``count_B[b]`` tokens (the first of row b's T ids) to each row; the new next-token logits."""
    B, T = ids_BT.shape
    W = conv.kv[0][0].shape[3]
    start = W - T
    j = jnp.arange(T)
    new_BT = j[None, :] < count_B[:, None]
    positions = conv.length[:, None] + j[None, :]
    cols = jnp.arange(W)[None, :]
    staged = jnp.pad(new_BT, ((0, 0), (start, 0)))
    key_valid = ((cols < conv.length[:, None]) | staged).astype(jnp.int32)
    out = model.forward_cached(ids_BT, positions, key_valid, conv.kv, start, record_routes=conv.routes is not None)
    hidden, kv = out[:2]
    routes = conv.routes
    if routes is not None:  # each row's T tokens' experts at its columns [length, length + T), -1 past its count
        new = jnp.where(new_BT[:, :, None, None], out[2], -1)
        routes = jax.vmap(lambda r, n, at: jax.lax.dynamic_update_slice_in_dim(r, n, at, axis=0))(
            routes, new, conv.length)
    specs = shards.cache(len(kv))
    kv = shards.local(functools.partial(_commit_local, width=T), (specs, shards.rows(1)), specs)(kv, conv.length)
    last = jnp.take_along_axis(hidden, jnp.maximum(count_B - 1, 0)[:, None, None], axis=1)
    logits = model.logits_from_hidden(last)[:, 0, :]
    logits = jnp.where((count_B > 0)[:, None], logits, conv.logits)
    conv = Conversations(kv=kv, length=conv.length + count_B, logits=logits, routes=routes)
    return shards.constrain(conv, conv.specs(shards))


def _ends_with(recent_BK: jax.Array, sequence: tuple[int, ...]) -> jax.Array:
    tail = recent_BK[:, recent_BK.shape[1] - len(sequence):]
    return jnp.all(tail == jnp.asarray(sequence, jnp.int32)[None, :], axis=1)


def decode_turn(model, conv: Conversations, limit_B: jax.Array, start_B: jax.Array, row_ids_B: jax.Array,
                key: jax.Array, params: SamplingParams, stop_sequences: tuple[tuple[int, ...], ...], turn_len: int,
                shards: BatchShards):
    """Draw up to ``limit_B[b] <= turn_len`` tokens per row, each fed back into the cache (the last one included:
    the conversation goes on after it). ``start_B`` is each row's response-token index of its first token here:
    token i of a row is drawn with the key of (row id, start + i), so the draws do not depend on turn boundaries.
    A row stops at an EOS id or when its tokens end with one of ``stop_sequences``.
    """
    B = limit_B.shape[0]
    keys = sample_keys(key, row_ids_B)
    longest = max([1] + [len(s) for s in stop_sequences])
    stops = tuple(stop_sequences) + (() if params.ignore_eos else tuple((e,) for e in params.eos_token_ids))
    rows = CPU_SAMPLE_ROWS if shards.platform == "cpu" else B
    sample = functools.partial(sample_in_row_chunks, params=params, rows=rows)

    def body(carry):
        conv, active, count, stopped, tokens, logps, recent, t = carry
        token, logp = sample(conv.logits, keys, start_B + count)
        token = jnp.where(active, token, params.pad_token_id)
        tokens = tokens.at[:, t].set(token)
        logps = logps.at[:, t].set(jnp.where(active, logp, 0.0))
        recent = jnp.concatenate([recent[:, 1:], token[:, None]], axis=1)
        hit = jnp.zeros((B,), bool)
        for s in stops:
            hit = hit | _ends_with(recent, s)
        conv = append(model, conv, token[:, None], active.astype(jnp.int32), shards)
        count = count + active
        stopped = stopped | (active & hit)
        active = active & ~hit & (count < limit_B)
        return conv, active, count, stopped, tokens, logps, recent, t + 1

    zeros = jnp.zeros((B,), jnp.int32)
    carry = (conv, limit_B > 0, zeros, jnp.zeros((B,), bool), jnp.full((B, turn_len), params.pad_token_id, jnp.int32),
             jnp.zeros((B, turn_len), jnp.float32), jnp.full((B, longest), -1, jnp.int32), jnp.int32(0))
    conv, _, count, stopped, tokens, logps, _, _ = jax.lax.while_loop(
        lambda c: jnp.any(c[1]) & (c[7] < turn_len), body, carry)
    return conv, TurnOutput(tokens=tokens, logprobs=logps, count=count, stopped=stopped)
