"""Sampling a prompt batch with the policy's parameters: shared by the trainer and ``python -m rlhf_jax.generate``.

One function, so that generating a data set offline draws exactly what the trainer's validation
draws on the same prompts and settings (same batch padding, same key).
"""

from __future__ import annotations

import jax
import numpy as np

from rlhf_jax.parallel import groups
from rlhf_jax.data import PromptBatch
from rlhf_jax.parallel import replicated
from rlhf_jax.rollout.buckets import bucket_batch
from rlhf_jax.parallel.hosts import to_global


def key_function(mesh):
    """A jitted (seed, step) -> key: one global (replicated) array, also across processes; seed and step are
    traced, so it compiles once. Its values equal ``rollout_key(seed, step)``."""
    fn = jax.jit(lambda s, t: jax.random.fold_in(jax.random.key(s), t), out_shardings=replicated(mesh))
    return lambda seed, step: fn(np.uint32(seed), np.uint32(step))


def generate_batch(sampler, params, mesh, dp_size: int, pb: PromptBatch, sampling, key, bucket: bool = True):
    """Sample from a (process-local) prompt batch; pads the batch to the data-parallel size, and with ``bucket``
    to a power of two (validation's batches vary in size; training's rollout is one size, every row its own).

    Returns the sampler's output and the number of its (process-local) rows that belong to ``pb``.
    """
    ids, mask = pb.input_ids, pb.attention_mask
    B = ids.shape[0]
    dp = max(dp_size // groups.process_count(), 1)
    padded = bucket_batch(B, multiple=dp) if bucket else -(-B // dp) * dp
    if padded != B:  # validation tails: repeat the first row, drop its samples afterwards
        ids = np.concatenate([ids, np.repeat(ids[:1], padded - B, 0)])
        mask = np.concatenate([mask, np.repeat(mask[:1], padded - B, 0)])
    out = sampler.generate(params, to_global(mesh, ids), to_global(mesh, mask), sampling, key)
    return out, B * sampling.n
