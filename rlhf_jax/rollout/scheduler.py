"""Continuous batching state: decode slots, each shard's queue of pending samples, refill and shrink.

M decode slots each decode one sample at a time, one token per loop step. A
sample's first token comes from its prompt's prefill logits; every sample
that still needs decoding waits in its shard's queue (local sample ids in id
order). Whenever a slot's sample ends (EOS, stop token or max length) the slot
takes the next pending sample of its shard: the prompt's KV is copied into
the slot's prompt columns and its position and mask state restart.

Slot cache, per layer: keys (M, K, D, S), values (M, K, S, D), S = P + R - 1 (the first loop may run on a
narrower cache while every response is short, and widens it once: ``narrow_width``).
Columns [0, P) hold the slot's left-padded prompt, column P + t the sample's
response token t, and column S - 1 is staging: the model writes a step's new
key and value at one cache index for all rows, and at S - 1 a query sees
every column. The next step first moves each slot's staged column to the
slot's own column (``commit_staged``, a scatter of one column per slot), then
runs the model; in that order XLA updates the cache in place (moving it after
the model's attention has read the cache makes XLA copy the whole cache).
Key validity is per slot, so a refilled slot never sees what its previous
sample left behind and nothing needs clearing.

Shrink: when every shard's queue is empty and few enough slots are live, the
live slots are compacted into the next smaller slot count (a quarter fewer; half as many once few are left),
and decoding goes on in a loop compiled for that size. The decode step has a large fixed cost
(reading the weights), so the tail of long responses is cheaper on a small
batch than on a mostly finished large one.

Every function here that touches a cache or a queue runs per shard
(``BatchShards.local``), on local sample ids. Under a context split each
device holds a block of every slot's columns: a refill writes the prompt
columns of its own block, and the commit sends the staged column (the last
block's) to the block that owns the slot's response column.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from rlhf_jax.rollout.prefill import PromptCache
from rlhf_jax.rollout.shards import BatchShards

# Slots when rollout.max_num_seqs is None and the batch is larger (vLLM's default max_num_seqs).
DEFAULT_MAX_SLOTS = 256
# Loops compiled per rollout: the slot count shrinks by a quarter at most QUARTER_PHASES - 1 times, and not below
# QUARTER_MIN_SLOTS per shard; then, for responses of at least HALVING_MIN_TOKENS, it halves down to one slot per
# shard (at most MAX_PHASES loops in all). At large counts a decode step's cost is mostly per row, so quarters keep
# the compiled batch close to the live count; at small counts it is mostly fixed (reading the weights: SmolLM2 on
# CPU 27 ms at 1 row, 47 ms at 8, 152 ms at 64), so halves follow the few long responses of a tail in few loops.
# Measured on SmolLM2, 64 short answers with a long tail: 512 new tokens -30 % rollout time; 128: -3 to -8 %, not
# worth three more compiled loops (about 8 s of compile each), hence the threshold.
QUARTER_PHASES = 6
QUARTER_MIN_SLOTS = 8
HALVING_MIN_TOKENS = 256
MAX_PHASES = 10
# The first loop reads a cache of P + R / 4 columns while every response is that short (a decode step's attention
# reads every cache column: SmolLM2 on CPU, 64 slots, 0.3 ms per column), when R / 4 is at least this many tokens.
# Measured: 512 new tokens +5-8 % (the first loop covers the 64-slot phase); 128: within noise, for one more
# compiled loop, hence the threshold.
NARROW_MIN_TOKENS = 64


def num_slots(num_samples: int, shards: int, max_num_seqs: int | None = None) -> int:
    """Decode slots: every sample at once up to the cap (``max_num_seqs`` or ``DEFAULT_MAX_SLOTS``).

    Rounded down to a multiple of the shard count (at least one slot per shard),
    never more than the samples.
    """
    cap = DEFAULT_MAX_SLOTS if max_num_seqs is None else max_num_seqs
    return max(1, min(num_samples, cap) // shards) * shards


def phase_sizes(slots: int, shards: int, response_len: int) -> tuple[int, ...]:
    """Slot counts of the successive decode loops (per shard, rounded down): three quarters of the one before while
    that leaves ``QUARTER_MIN_SLOTS`` (``QUARTER_PHASES`` loops at most), then, when ``response_len`` is at least
    ``HALVING_MIN_TOKENS``, half of it down to one per shard.

    Steps of a quarter keep the compiled batch close to the live count as
    responses end (halving would leave up to half the slots idle); once few
    slots are left, a step's fixed cost dominates, and the halving tail
    follows the last long responses in few loops.
    """
    sizes, per_shard = [slots], slots // shards
    while per_shard * 3 // 4 >= QUARTER_MIN_SLOTS and len(sizes) < QUARTER_PHASES:
        per_shard = per_shard * 3 // 4
        sizes.append(per_shard * shards)
    while per_shard > 1 and len(sizes) < MAX_PHASES and response_len >= HALVING_MIN_TOKENS:
        per_shard //= 2
        sizes.append(per_shard * shards)
    return tuple(sizes)


@struct.dataclass
class Slots:
    """The decode slots; every array's leading axis is the slot axis."""

    sample: jax.Array  # (M,) int32 shard-local id of the slot's sample, -1 when free
    t: jax.Array  # (M,) int32 index of the token the slot draws next (tokens 0 .. t - 1 exist)
    last: jax.Array  # (M,) int32 token t - 1, fed to the next decode step
    prompt_mask: jax.Array  # (M, P) int32 the mask of the sample's prompt
    cache: list  # per layer (keys (M, K, D, S), values (M, K, S, D))

    def specs(self, shards: BatchShards) -> "Slots":
        return Slots(shards.rows(1), shards.rows(1), shards.rows(1), shards.rows(2),
                     shards.cache(len(self.cache), split_length=True))

    def key_valid(self) -> jax.Array:
        """(M, S): the prompt's tokens, response tokens 0 .. t - 2 (committed) and the staging column (token t - 1)."""
        M, P, S = self.sample.shape[0], self.prompt_mask.shape[1], self.cache[0][0].shape[3]
        response = jnp.arange(S - 1 - P)[None, :] < (self.t - 1)[:, None]
        return jnp.concatenate([self.prompt_mask, response.astype(jnp.int32), jnp.ones((M, 1), jnp.int32)], axis=1)

    def positions(self) -> jax.Array:
        """(M,) position id of the token fed back this step (token t - 1)."""
        return jnp.sum(self.prompt_mask, axis=1) + self.t - 1


@struct.dataclass
class Queue:
    """Per shard: its pending samples' local ids in id order, how many there are, and how many were taken."""

    order: jax.Array  # (N,) int32
    count: jax.Array  # (shards,) int32
    head: jax.Array  # (shards,) int32

    def specs(self, shards: BatchShards) -> "Queue":
        return Queue(shards.rows(1), shards.rows(1), shards.rows(1))


@struct.dataclass
class Responses:
    """The (N, R) output buffers, indexed by sample id."""

    tokens: jax.Array  # (N, R) int32, the pad id where nothing was drawn
    mask: jax.Array  # (N, R) int32
    logprobs: jax.Array  # (N, R) float32
    finished: jax.Array  # (N,) bool: the sample ended with a stop token
    # (N, R, sparse layers, K) int32: the expert ids of each response token when it was fed back (-1: never
    # fed, e.g. the last), with routes recording (router_replay R3); else None
    routes: jax.Array | None = None

    def specs(self, shards: BatchShards) -> "Responses":
        routes = None if self.routes is None else shards.rows(4)
        return Responses(shards.rows(2), shards.rows(2), shards.rows(2), shards.rows(1), routes)


def is_stop(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    hit = jnp.zeros(tokens.shape, bool)
    for e in stop_ids:
        hit = hit | (tokens == e)
    return hit


# ---------------------------------------------------------------------- shard-local functions


def _first_logits_local(prompts: PromptCache, num_samples: int, n: int) -> jax.Array:
    rank = prompts.rank[jnp.arange(num_samples) // n]
    return prompts.logits[rank // prompts.group_size, rank % prompts.group_size]


def _queue_local(pending: jax.Array) -> Queue:
    order = jnp.argsort(~pending, stable=True).astype(jnp.int32)
    count = jnp.sum(pending, dtype=jnp.int32)[None]
    return Queue(order=order, count=count, head=jnp.zeros_like(count))


def _copy_prompt(cache: list, prompts: PromptCache, slot: jax.Array, rank: jax.Array, block_start=0) -> list:
    """The prompt of ``rank`` into the prompt columns of ``slot``, every layer; under a context split only the
    columns of this device's block (global columns from ``block_start``), which are a prefix of the block."""
    group, row = rank // prompts.group_size, rank % prompts.group_size
    P, local = prompts.kv[0][0].shape[-1], cache[0][0].shape[3]
    width = min(P, local)  # prompt columns a block can hold
    if width == P and isinstance(block_start, int):  # one block holds the whole prompt: copy it as is
        start, shift, keep = 0, 0, None
    else:  # columns [block_start, block_start + width) of the prompt; dynamic_slice clamps the start, roll undoes it
        start = jnp.clip(block_start, 0, P - width)
        shift = block_start - start
        keep = block_start + jnp.arange(width) < P
    out = []
    for (k, v), (pk, pv) in zip(cache, prompts.kv):
        src_k = jax.lax.dynamic_slice(pk, (group, row, 0, 0, start), (1, 1) + pk.shape[2:4] + (width,))[0]
        src_v = jax.lax.dynamic_slice(pv, (group, row, 0, start, 0), (1, 1, pv.shape[2], width, pv.shape[4]))[0]
        if keep is not None:
            old_k = jax.lax.dynamic_slice(k, (slot, 0, 0, 0), src_k.shape)
            old_v = jax.lax.dynamic_slice(v, (slot, 0, 0, 0), src_v.shape)
            src_k = jnp.where(keep, jnp.roll(src_k, -shift, axis=3), old_k)
            src_v = jnp.where(keep[:, None], jnp.roll(src_v, -shift, axis=2), old_v)
        out.append((jax.lax.dynamic_update_slice(k, src_k, (slot, 0, 0, 0)),
                    jax.lax.dynamic_update_slice(v, src_v, (slot, 0, 0, 0))))
    return out


def _refill_local(slots: Slots, queue: Queue, prompts: PromptCache, first_token: jax.Array, n: int, block_start=0):
    """Free slots take the next pending samples in order; only the refilled slots' KV is written."""
    free = slots.sample < 0
    index = queue.head + jnp.cumsum(free) - 1
    take = free & (index < queue.count)
    sample = jnp.where(take, queue.order[jnp.clip(index, 0, queue.order.shape[0] - 1)], slots.sample)
    prompt = jnp.maximum(sample, 0) // n
    taken = jnp.sum(take, dtype=jnp.int32)
    refilled = jnp.nonzero(take, size=take.shape[0], fill_value=0)[0]
    rank = prompts.rank[prompt]
    cache = jax.lax.fori_loop(
        0, taken, lambda i, c: _copy_prompt(c, prompts, refilled[i], rank[refilled[i]], block_start), slots.cache)
    slots = Slots(
        sample=sample,
        t=jnp.where(take, 1, slots.t),
        last=jnp.where(take, first_token[jnp.maximum(sample, 0)], slots.last),
        prompt_mask=jnp.where(take[:, None], prompts.mask[prompt], slots.prompt_mask),
        cache=cache,
    )
    return slots, queue.replace(head=queue.head + taken)


def _commit_local(slots: Slots, shards: BatchShards) -> list:
    """Each live slot's staged key/value (token t - 2, fed back last step) to its column P + t - 2.

    A slot that has not fed a token back yet (t < 2, just refilled) or is free
    "moves" the staging column onto itself. Under a context split the staging
    column lies in the last device's block: its keys and values (one token per
    slot) are summed over the context axis from that device alone, and each
    device writes the columns of its own block.
    """
    P = slots.prompt_mask.shape[1]
    local = slots.cache[0][0].shape[3]
    staging = local * shards.length_ways - 1
    column = jnp.where((slots.sample >= 0) & (slots.t >= 2), P + slots.t - 2, staging)
    rows = jnp.arange(column.shape[0])
    if shards.length_ways == 1:
        return [(k.at[rows, :, :, column].set(k[:, :, :, staging]), v.at[rows, :, column, :].set(v[:, :, staging, :]))
                for k, v in slots.cache]
    block = shards.length_block()
    column = column - block * local
    column = jnp.where((column >= 0) & (column < local), column, local)  # another block's column: dropped

    def staged(x):  # the last block's last column, on every device of the context group
        return jax.lax.psum(jnp.where(block == shards.length_ways - 1, x, jnp.zeros_like(x)), shards.length_axes)
    return [(k.at[rows, :, :, column].set(staged(k[:, :, :, -1]), mode="drop"),
             v.at[rows, :, column, :].set(staged(v[:, :, -1, :]), mode="drop")) for k, v in slots.cache]


def _prepare_local(slots: Slots, queue: Queue, prompts: PromptCache, first_token: jax.Array, n: int,
                   shards: BatchShards):
    """Before a decode step: refill the slots freed by the last one, then commit the staged column."""
    block_start = shards.length_block() * slots.cache[0][0].shape[3] if shards.length_ways > 1 else 0
    slots, queue = _refill_local(slots, queue, prompts, first_token, n, block_start)
    return slots.replace(cache=_commit_local(slots, shards)), queue


def _record_local(sample, t, responses: Responses, tokens, logps, routes, *, stop_ids):
    """Write the step's tokens at (sample, t) (and the routes of the token fed back, t - 1); free the slots whose
    sample ended."""
    R = responses.tokens.shape[1]
    live = sample >= 0
    rows = jnp.where(live, sample, responses.finished.shape[0])  # out of range: dropped
    cols = jnp.minimum(t, R - 1)
    stop = is_stop(tokens, stop_ids)
    responses = Responses(
        tokens=responses.tokens.at[rows, cols].set(tokens, mode="drop"),
        mask=responses.mask.at[rows, cols].set(1, mode="drop"),
        logprobs=responses.logprobs.at[rows, cols].set(logps, mode="drop"),
        finished=responses.finished.at[rows].set(stop, mode="drop"),
        routes=None if routes is None else responses.routes.at[rows, t - 1].set(routes, mode="drop"),
    )
    done = live & (stop | (t + 1 >= R))
    return jnp.where(done, -1, sample), responses


def _shrink_local(slots: Slots, size: int) -> Slots:
    keep = jnp.argsort(slots.sample < 0, stable=True)[:size]  # live slots first
    return jax.tree.map(lambda x: x[keep], slots)


# ---------------------------------------------------------------------- global wrappers


def _sample_routes_local(prompts: PromptCache, response_routes: jax.Array, n: int) -> jax.Array:
    rank = prompts.rank
    prompt_routes = prompts.routes[rank // prompts.group_size, rank % prompts.group_size]
    return jnp.concatenate([jnp.repeat(prompt_routes, n, axis=0), response_routes], axis=1)


def sample_routes(prompts: PromptCache, responses: Responses, n: int, shards: BatchShards) -> jax.Array:
    """(N, P + R, sparse layers, K): each sample's prompt routes (its prompt's, in the original order) followed
    by its response routes."""
    fn = functools.partial(_sample_routes_local, n=n)
    return shards.local(fn, (prompts.specs(shards), shards.rows(4)), shards.rows(4))(prompts, responses.routes)


def first_token_logits(prompts: PromptCache, n: int, shards: BatchShards) -> jax.Array:
    """(N, V) next-token logits of each sample's prompt (prompt-major), gathered on each prompt's shard."""
    num_samples = prompts.rank.shape[0] * n
    fn = functools.partial(_first_logits_local, num_samples=num_samples // shards.count, n=n)
    return shards.local(fn, (prompts.specs(shards),), shards.rows(2))(prompts)


def start_queue(pending: jax.Array, shards: BatchShards) -> Queue:
    """Each shard's queue of the samples that still need decoding (their first token did not end them)."""
    return shards.local(_queue_local, (shards.rows(1),), Queue(shards.rows(1), shards.rows(1), shards.rows(1)))(pending)


def narrow_width(prompt_len: int, response_len: int) -> int | None:
    """The cache width of the first decode loop when it pays to start narrow (see ``fits``), else None."""
    quarter = response_len // 4
    return prompt_len + quarter if quarter >= NARROW_MIN_TOKENS else None


def fits(slots: Slots, width: int) -> jax.Array:
    """Every live slot's next commit (column P + t - 2) lands before the staging column of a ``width``-column cache."""
    P = slots.prompt_mask.shape[1]
    return jnp.all(jnp.where(slots.sample >= 0, slots.t, 0) <= width - P)


def widen(slots: Slots, width: int, shards: BatchShards) -> Slots:
    """The cache grown to ``width`` columns: same columns, the staging column moved to the new last one."""
    def grow(k, v):
        w = k.shape[3]
        pad_k = jnp.zeros(k.shape[:3] + (width - w,), k.dtype)
        pad_v = jnp.zeros(v.shape[:2] + (width - w,) + v.shape[3:], v.dtype)
        return (jnp.concatenate([k[..., :w - 1], pad_k, k[..., w - 1:]], axis=3),
                jnp.concatenate([v[:, :, :w - 1], pad_v, v[:, :, w - 1:]], axis=2))
    cache = shards.constrain([grow(k, v) for k, v in slots.cache], shards.cache(len(slots.cache), split_length=True))
    return slots.replace(cache=cache)


def empty_slots(model, slots: int, prompt_len: int, width: int, shards: BatchShards) -> Slots:
    """``slots`` free slots with a ``width``-column cache (P prompt columns, response columns, staging)."""
    cache = model.init_cache(slots, width)
    cache = shards.constrain(cache, shards.cache(model.config.num_hidden_layers, split_length=True))
    zeros = jnp.zeros((slots,), jnp.int32)
    prompt_mask = jnp.zeros((slots, prompt_len), jnp.int32)
    empty = Slots(sample=zeros - 1, t=zeros, last=zeros, prompt_mask=prompt_mask, cache=cache)
    return shards.constrain(empty, empty.specs(shards))


def prepare(slots: Slots, queue: Queue, prompts: PromptCache, first_token: jax.Array, n: int, shards: BatchShards):
    """Refill the free slots from their shard's queue and commit last step's staged keys and values.

    Every cache write of a step (refill, commit, the model's own) comes before
    the model's attention reads it, so XLA keeps the cache in place; a refill
    after the reads makes it copy the cache.
    """
    fn = functools.partial(_prepare_local, n=n, shards=shards)
    specs = (slots.specs(shards), queue.specs(shards))
    return shards.local(fn, specs + (prompts.specs(shards), shards.rows(1)), specs)(slots, queue, prompts, first_token)


def record(slots: Slots, responses: Responses, tokens: jax.Array, logps: jax.Array, stop_ids, shards: BatchShards,
           routes: jax.Array | None = None):
    """After a decode step: record each live slot's token (and ``routes`` (M, sparse layers, K), the expert ids of
    the token it fed back), end finished samples, advance the slots."""
    r1 = shards.rows(1)
    route_spec = None if routes is None else shards.rows(3)
    fn = shards.local(functools.partial(_record_local, stop_ids=stop_ids),
                      (r1, r1, responses.specs(shards), r1, r1, route_spec), (r1, responses.specs(shards)))
    sample, responses = fn(slots.sample, slots.t, responses, tokens, logps, routes)
    return slots.replace(sample=sample, t=slots.t + 1, last=tokens), responses


def shrink(slots: Slots, size: int, shards: BatchShards) -> Slots:
    """The live slots compacted into ``size`` slots (every shard keeps its own, in slot order)."""
    fn = functools.partial(_shrink_local, size=size // shards.count)
    specs = slots.specs(shards)
    return shards.local(fn, (specs,), specs)(slots)


def can_shrink(slots: Slots, queue: Queue, size: int, shards: BatchShards) -> jax.Array:
    """Every queue is empty and every shard has at most ``size / shards`` slots live."""
    live = jnp.sum((slots.sample >= 0).reshape(shards.count, -1), axis=1)
    return jnp.all(queue.head >= queue.count) & jnp.all(live <= size // shards.count)


def global_sample_ids(slots: Slots, samples_per_shard: int, shards: BatchShards) -> jax.Array:
    """(M,) global sample id of each slot (the id its PRNG stream is keyed by); free slots get their shard's first."""
    shard = jnp.arange(slots.sample.shape[0]) // (slots.sample.shape[0] // shards.count)
    return shard * samples_per_shard + jnp.maximum(slots.sample, 0)
