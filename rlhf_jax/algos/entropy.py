"""Entropy and token log-probs from logits, computed in chunks over the sequence.

A (batch, length, vocab) float32 tensor (the upcast logits, softmax, or
log-softmax) is never materialised whole: a scan visits sequence chunks of
``chunk_size`` positions, each rematerialised in the backward pass
(``jax.checkpoint``), so peak extra memory is O(batch * chunk * vocab).
Temperature scaling (logits / T) happens inside the chunk, as the trainer
scores tokens at the sampling temperature.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray

# Auto chunking keeps one chunk's float32 (batch, chunk, vocab) under this many bytes.
DEFAULT_CHUNK_BYTES = 128 * 1024 * 1024


def auto_chunk_size(batch: int, length: int, vocab: int, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Largest chunk (<= length) whose float32 (batch, chunk, vocab) block fits in ``budget_bytes``."""
    per_pos = max(1, batch * vocab * 4)
    return int(max(1, min(length, budget_bytes // per_pos)))


def map_sequence_chunks(fn: Callable[..., Any], *arrays: Array, chunk_size: int | None = None) -> Any:
    """Apply ``fn`` to sequence chunks of ``arrays`` (all (batch, length, ...)); reassemble (batch, length, ...).

    ``fn`` maps chunks (batch, c, ...) to a pytree of (batch, c, ...) arrays. The last
    chunk is shifted back to end at ``length`` (it overlaps its neighbour) so no
    padding copy of the inputs is made; each position is read from exactly one chunk.
    """
    b, t = arrays[0].shape[:2]
    c = auto_chunk_size(b, t, arrays[0].shape[-1]) if chunk_size is None else int(chunk_size)
    if c <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if c >= t:
        return fn(*arrays)
    n = math.ceil(t / c)
    starts = np.minimum(np.arange(n) * c, t - c).astype(np.int32)

    @jax.checkpoint
    def one(arrs: tuple[Array, ...], start: Array) -> Any:
        return fn(*(jax.lax.dynamic_slice_in_dim(a, start, c, axis=1) for a in arrs))

    ys = jax.lax.map(lambda s: one(arrays, s), jnp.asarray(starts))  # leaves (n, batch, c)
    pos = np.arange(t)
    k = np.minimum(pos // c, n - 1)
    off = pos - starts[k]
    # y[k, :, off] puts the position axis first: (t, batch, ...) -> (batch, t, ...)
    return jax.tree.map(lambda y: jnp.moveaxis(y[k, :, off], 0, 1), ys)


def _scaled(logits: Array, temperature: float) -> Array:
    z = logits.astype(jnp.float32)
    return z if temperature == 1.0 else z / temperature


def _entropy_chunk(z: Array) -> Array:
    # -sum p log p equals logsumexp(z) - sum p z, but every term is >= 0: no float32 cancellation.
    logp = jax.nn.log_softmax(z, axis=-1)
    # A contraction, not multiply-then-sum: XLA:CPU runs the latter ~5x slower over a vocabulary.
    return -jnp.einsum("...v,...v->...", jnp.exp(logp), logp)


def _logprob_chunk(z: Array, ids: Array) -> Array:
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - lse


def entropy_from_logits(logits: Array, *, temperature: float = 1.0, chunk_size: int | None = None) -> Array:
    """Per-token entropy H = logsumexp(z) - sum softmax(z) z of z = logits / temperature; (batch, length) float32."""
    return map_sequence_chunks(lambda x: _entropy_chunk(_scaled(x, temperature)), logits, chunk_size=chunk_size)


def token_log_probs(
    logits: Array, token_ids: Array, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Array:
    """log_softmax(logits / temperature) gathered at ``token_ids``; (batch, length) float32."""
    return map_sequence_chunks(
        lambda x, ids: _logprob_chunk(_scaled(x, temperature), ids), logits, token_ids, chunk_size=chunk_size
    )


def token_log_probs_and_entropy(
    logits: Array, token_ids: Array, *, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[Array, Array]:
    """Both token log-probs and entropy in one chunked pass over the logits."""

    def both(x: Array, ids: Array) -> tuple[Array, Array]:
        z = _scaled(x, temperature)
        return _logprob_chunk(z, ids), _entropy_chunk(z)

    return map_sequence_chunks(both, logits, token_ids, chunk_size=chunk_size)
