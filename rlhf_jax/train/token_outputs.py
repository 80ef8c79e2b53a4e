"""What a pass reads off the vocabulary projection at each position, chunk by chunk over the sequence so a
(b, T, vocab) float32 tensor never exists whole (and is rematerialised in the backward pass): the log-prob of a
given token, the entropy or the sum of squared probabilities, the log-probs of given token sets, and the top-k
tokens with their log-probs (the distillation teacher's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhf_jax import algos
from rlhf_jax.algos.entropy import auto_chunk_size


def _scaled_logits(model, h, temperature: float):
    z = model.logits_from_hidden(h)
    return z if temperature == 1.0 else z / temperature


def token_log_probs(model, hidden, ids, temperature: float, with_entropy: bool, with_sum_pi_squared: bool = False,
                    at_ids=None):
    """(log-probs of ``ids``, and entropies -- or with ``with_sum_pi_squared`` the sum over the vocabulary of the
    squared probabilities -- or None), (b, T) float32, from the hidden states that predict them. ``at_ids``
    (b, T, k) int: a third output, the log-probs (b, T, k) of those tokens at each position (the student's at the
    teacher's top-k, forward_kl_topk)."""
    chunk = auto_chunk_size(hidden.shape[0], hidden.shape[1], model.config.vocab_size)

    def per_chunk(h, tok, *at):
        z = _scaled_logits(model, h, temperature)
        lse = jax.nn.logsumexp(z, axis=-1)
        outs = [jnp.take_along_axis(z, tok[..., None].astype(jnp.int32), axis=-1)[..., 0] - lse]
        if with_sum_pi_squared:  # the optimal token baseline's path variance reads it (algos.optimal_baseline)
            p = jnp.exp(z - lse[..., None])
            outs.append(jnp.einsum("...v,...v->...", p, p))
        elif with_entropy:
            # sum_v p z as a contraction: XLA:CPU's library fusion runs the same multiply-then-reduce ~5x slower
            # (it was 0.8 s of a 4 s SmolLM2 update micro-batch).
            outs.append(lse - jnp.einsum("...v,...v->...", jnp.exp(z - lse[..., None]), z))
        if at:
            outs.append(jnp.take_along_axis(z, at[0].astype(jnp.int32), axis=-1) - lse[..., None])
        return tuple(outs)

    out = algos.map_sequence_chunks(per_chunk, hidden, ids, *(() if at_ids is None else (at_ids,)),
                                    chunk_size=chunk)
    second = out[1] if with_entropy or with_sum_pi_squared else None
    return (out[0], second) if at_ids is None else (out[0], second, out[-1])


def token_top_k(model, hidden, k: int, temperature: float = 1.0):
    """(log-probs (b, T, k) float32, token ids (b, T, k) int32) of the ``k`` most probable tokens of each position's
    full log-softmax at ``temperature``, most probable first."""
    chunk = auto_chunk_size(hidden.shape[0], hidden.shape[1], model.config.vocab_size)

    def per_chunk(h):
        z = _scaled_logits(model, h, temperature)
        top, ids = jax.lax.top_k(z, k)  # the log-softmax is z - lse: the same order
        return top - jax.nn.logsumexp(z, axis=-1)[..., None], ids.astype(jnp.int32)

    return algos.map_sequence_chunks(per_chunk, hidden, chunk_size=chunk)
