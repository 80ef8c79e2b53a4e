"""Partial rollouts: responses sampled in segments, with new weights allowed between segments.

The sampler's program (decode.py) runs prefill and every decode step in one traced function, so new weights
cannot enter a sequence mid-program. A response is therefore sampled ``segment`` tokens at a time: the first
segment from the prompts (``n`` samples each), every later one from each sample's prompt followed by its tokens so
far, prefilled again with whatever weights the sampler holds by then (AReaL's interruptible generation: the
cache is rebuilt, not kept). Between segments ``refresh()`` may hand over newer weights; each token records the
version of the weights that drew it (``RolloutBatch.versions``). A sample that has ended stays ended; its row
rides along in later segments (fixed shapes: one program per segment length) and its new tokens are dropped.

The recorded log-probs are the drawing weights' own (log_softmax(logits / temperature)), so the training side's
``algorithm.rollout_correction`` corrects every token against the weights it trains from, whichever version
drew it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rlhf_jax.rollout.params import SamplingParams
from rlhf_jax.types import RolloutBatch

# (weights, prompt ids (N, P), prompt mask (N, P), params, key) -> RolloutBatch
Generate = Callable[[Any, jax.Array, jax.Array, SamplingParams, jax.Array], RolloutBatch]
# () -> (newer weights, their version), or None to keep the ones held
Refresh = Callable[[], "tuple[Any, int] | None"]


def segment_lengths(response_length: int, segment: int) -> list[int]:
    """The lengths of the segments of a response of ``response_length`` tokens (the last one may be shorter)."""
    return [min(segment, response_length - start) for start in range(0, response_length, segment)]


@functools.partial(jax.jit, static_argnames=("pad",))
def _continued_prompts(prompts, prompt_mask, tokens, mask, *, pad: int):
    """Each sample's prompt followed by its tokens so far, left-padded again (N, P + t): an ended sample's row
    keeps its holes, and its continuation is dropped."""
    ids = jnp.concatenate([prompts, tokens], axis=1)
    valid = jnp.concatenate([prompt_mask, mask], axis=1)
    # move the valid tokens to the right end (a stable sort on validity keeps their order)
    order = jnp.argsort(valid, axis=1, stable=True)
    ids, valid = jnp.take_along_axis(ids, order, axis=1), jnp.take_along_axis(valid, order, axis=1)
    return jnp.where(valid > 0, ids, pad), valid


@functools.partial(jax.jit, static_argnames=("start", "pad"), donate_argnums=(0,))
def _merged(buffers: dict, part: RolloutBatch, version, *, start: int, pad: int) -> dict:
    """Write a segment's tokens at columns [start, start + L) of the rows still running, and their version."""
    running = ~buffers["finished"]
    length = part.responses.shape[1]
    take = running[:, None] & (part.response_mask > 0)
    cols = slice(start, start + length)
    out = dict(buffers)
    out["responses"] = buffers["responses"].at[:, cols].set(jnp.where(take, part.responses, pad))
    out["response_mask"] = buffers["response_mask"].at[:, cols].set(jnp.where(take, part.response_mask, 0))
    out["logprobs"] = buffers["logprobs"].at[:, cols].set(jnp.where(take, part.logprobs, 0.0))
    out["versions"] = buffers["versions"].at[:, cols].set(jnp.where(take, version, -1))
    out["finished"] = buffers["finished"] | (running & part.finished)
    return out


def generate_in_segments(generate: Generate, weights: Any, version: int, prompt_ids, prompt_mask,
                         params: SamplingParams, key: jax.Array, segment: int,
                         refresh: Refresh | None = None) -> tuple[RolloutBatch, list[int]]:
    """Sample ``params.n`` responses per prompt, ``segment`` tokens at a time, starting with ``weights`` of version
    ``version`` and taking newer ones from ``refresh`` between segments. Returns the batch (``versions`` filled:
    the version that drew each token, -1 where none was drawn) and the version each segment ran with."""
    lengths = segment_lengths(params.max_new_tokens, segment)
    first = generate(weights, prompt_ids, prompt_mask, params.replace(max_new_tokens=lengths[0]), key)
    N, R, pad = first.responses.shape[0], params.max_new_tokens, int(params.pad_token_id)
    sharding = first.responses.sharding
    buffers = {
        "responses": jnp.full((N, R), pad, jnp.int32, device=sharding),
        "response_mask": jnp.zeros((N, R), jnp.int32, device=sharding),
        "logprobs": jnp.zeros((N, R), jnp.float32, device=sharding),
        "versions": jnp.full((N, R), -1, jnp.int32, device=sharding),
        "finished": jnp.zeros((N,), bool, device=first.finished.sharding),
    }
    buffers = _merged(buffers, first, jnp.int32(version), start=0, pad=pad)
    used, start = [version], lengths[0]
    for length in lengths[1:]:
        # at the boundary itself: dispatch is asynchronous, so without this wait every segment would be queued
        # before the first had run, and an update arriving meanwhile could not be taken
        jax.block_until_ready(buffers["finished"])
        newer = refresh() if refresh is not None else None
        if newer is not None:
            weights, version = newer
        ids, mask = _continued_prompts(first.prompts, first.prompt_mask, buffers["responses"][:, :start],
                                       buffers["response_mask"][:, :start], pad=pad)
        cont = params.replace(n=1, max_new_tokens=length, min_new_tokens=max(0, params.min_new_tokens - start))
        part = generate(weights, ids, mask, cont, jax.random.fold_in(key, start))
        buffers = _merged(buffers, part, jnp.int32(version), start=start, pad=pad)
        used.append(version)
        start += length
    batch = RolloutBatch(prompts=first.prompts, prompt_mask=first.prompt_mask, responses=buffers["responses"],
                         response_mask=buffers["response_mask"], logprobs=buffers["logprobs"],
                         finished=buffers["finished"], versions=buffers["versions"])
    return batch, used


class SegmentedSampler:
    """A sampler (``generate(weights, ids, mask, params, key)``) whose responses are drawn in segments of
    ``segment`` tokens, starting with version ``version`` and taking newer weights from ``refresh``; ``used``
    lists the version of each segment drawn so far. A later call (dynamic sampling's further batches) starts with
    the newest weights an earlier one took."""

    def __init__(self, sampler, segment: int, version: int, refresh: Refresh | None):
        self.sampler, self.segment, self.version, self.refresh = sampler, segment, version, refresh
        self.used: list[int] = []
        self._newest: tuple[Any, int] | None = None  # (weights, version) taken from ``refresh``

    def _refresh(self) -> tuple[Any, int] | None:
        newer = self.refresh() if self.refresh is not None else None
        if newer is not None:
            self._newest = newer
        return newer

    def generate(self, weights, prompt_ids, prompt_mask, params: SamplingParams, key) -> RolloutBatch:
        weights, version = self._newest if self._newest is not None else (weights, self.version)
        batch, used = generate_in_segments(self.sampler.generate, weights, version, prompt_ids, prompt_mask,
                                           params, key, self.segment, self._refresh)
        self.used += used
        return batch
