"""Pure array functions that turn sequence scores into token rewards.

- ``overlong_penalty``: DAPO's soft length penalty (reward_model.overlong_buffer):
  for a response of length L, max length L_max and buffer L_buf,
  ``min(-(L - (L_max - L_buf)) / L_buf * penalty_factor, 0)``, i.e. 0 until the
  last L_buf tokens, then falling linearly to ``-penalty_factor`` at L_max.
- ``place_on_last_token``: a (batch, response_length) array that is zero except
  for each sequence's score on its last valid response token.
"""

from __future__ import annotations

import jax.numpy as jnp


def overlong_penalty(
    response_length_B: jnp.ndarray, max_response_length: int, buffer_len: int, penalty_factor: float
) -> jnp.ndarray:
    """DAPO overlong penalty per sequence (float32 [B], <= 0)."""
    if buffer_len <= 0 or buffer_len > max_response_length:
        raise ValueError(
            f"reward_model.overlong_buffer.len must be in [1, max_response_length={max_response_length}], "
            f"got {buffer_len}"
        )
    length = jnp.asarray(response_length_B, dtype=jnp.float32)
    expected = max_response_length - buffer_len
    return jnp.minimum(-(length - expected) / buffer_len * penalty_factor, 0.0).astype(jnp.float32)


def place_on_last_token(score_B: jnp.ndarray, response_mask_BxT: jnp.ndarray) -> jnp.ndarray:
    """Token rewards [B, T]: score_B[b] at the last t with mask[b, t] != 0, zeros elsewhere.

    A row with no valid token gets all zeros (its score has nowhere to go). Jittable.
    """
    mask = jnp.asarray(response_mask_BxT) != 0
    T = mask.shape[-1]
    positions = jnp.arange(T)
    last_t_B = jnp.max(jnp.where(mask, positions, -1), axis=-1)  # -1 when the row is empty
    one_hot = positions[None, :] == last_t_B[:, None]
    return jnp.where(one_hot, jnp.asarray(score_B, dtype=jnp.float32)[:, None], 0.0).astype(jnp.float32)
