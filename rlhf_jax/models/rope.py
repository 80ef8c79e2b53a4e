"""Rotary position embeddings with every scaling type transformers implements for decoders.

``rope_type`` is one of ROPE_TYPES, read from a checkpoint's ``rope_scaling`` / ``rope_parameters``
(see ``config.py``). Each type reproduces transformers' ``modeling_rope_utils`` definition:

- default: inv_freq = 1 / theta ** (2i / D).
- linear: inv_freq / factor.
- llama3: low frequencies divided by ``factor``, high ones kept, a smooth ramp between.
- yarn: a per-frequency ramp between interpolated (/ factor) and original frequencies, and cos/sin
  scaled by an attention factor (0.1 ln(factor) + 1 unless given).
- dynamic (NTK): once a call reaches beyond ``max_position_embeddings`` the base grows with the
  length. transformers measures the length as max(position_ids) + 1 of each forward call, so the
  frequencies here are a function of the call's positions too (a traced value, not a constant):
  in a cached decode the new tokens use the grown base while cached keys keep theirs, as there, and
  the frequencies depend on which rows share the call (its batch), as there.
- longrope: per-frequency ``short_factor`` divisors while the call's max position + 1 is at most
  ``original_max_position_embeddings``, ``long_factor`` beyond; cos/sin scaled by
  sqrt(1 + ln(factor) / ln(original)) unless an attention factor is given.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear, dynamic, yarn, llama3, longrope (its attention factor only)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope: the pretraining context
    max_position_embeddings: int = 2048  # dynamic: the length up to which the base is unchanged
    attention_factor: float | None = None  # yarn, longrope: cos/sin scale (None: derived from factor)
    beta_fast: float = 32.0  # yarn: ramp bounds, in rotations over the original context
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn: attention factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: round the ramp bounds to whole dimensions
    short_factor: tuple[float, ...] = ()  # longrope: one divisor per frequency
    long_factor: tuple[float, ...] = ()
    partial_rotary_factor: float = 1.0  # the leading fraction of each head that rotates (Phi-3 family); the rest passes

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


def _default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def _llama3(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(inv_freq: np.ndarray, head_dim: int, rope: RopeConfig) -> np.ndarray:
    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the context
        return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = 1 - ramp  # 1: the original (extrapolated) frequency, 0: interpolated
    return (inv_freq / rope.factor * (1 - keep) + inv_freq * keep).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_scaling(rope: RopeConfig) -> float:
    """The factor transformers multiplies cos and sin by (so q.k scales by its square)."""
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.rope_type == "yarn":
        if rope.mscale and rope.mscale_all_dim:
            return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
        return _yarn_mscale(rope.factor)
    if rope.rope_type == "longrope" and rope.factor > 1.0:
        return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
    return 1.0


def static_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies (head_dim // 2,) float32 that do not depend on the call (dynamic: short calls;
    longrope: calls within the original context)."""
    inv_freq = _default_inv_freq(head_dim, rope.theta)
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn(inv_freq, head_dim, rope)
    if rope.rope_type == "longrope":
        return (inv_freq / np.asarray(rope.short_factor, np.float32)).astype(np.float32)
    return inv_freq


def inv_freq_for_call(head_dim: int, rope: RopeConfig, positions_BT: jax.Array) -> jax.Array:
    """Inverse frequencies for one forward call over ``positions_BT`` (see the module doc for why it depends on them)."""
    static = jnp.asarray(static_inv_freq(head_dim, rope))
    if rope.rope_type not in ("dynamic", "longrope"):
        return static
    seq_len = jnp.max(positions_BT) + 1
    if rope.rope_type == "longrope":
        long = _default_inv_freq(head_dim, rope.theta) / np.asarray(rope.long_factor, np.float32)
        return jnp.where(seq_len > rope.original_max_position_embeddings, jnp.asarray(long, jnp.float32), static)
    # dynamic NTK, in float32 as transformers computes it from the (tensor) length
    max_pos, factor = rope.max_position_embeddings, rope.factor
    length = jnp.maximum(seq_len, max_pos).astype(jnp.float32)
    base = rope.theta * ((factor * length / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
    grown = 1.0 / base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    return jnp.where(seq_len > max_pos, grown, static)


def rotary_cos_sin(head_dim: int, rope: RopeConfig, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each (B, T, 1, rotary dim) float32, scaled by the type's attention factor.

    Every frequency formula sees the rotary dim as the head size, as transformers' do."""
    inv_freq = inv_freq_for_call(rope.rotary_dim(head_dim), rope, positions_BT)
    angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    scale = attention_scaling(rope)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x_BTHD: jax.Array, cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half rotary embedding (the transformers convention) of the leading rotary dims, in float32."""
    cos, sin = cos_sin
    rot = cos.shape[-1]
    x32 = x_BTHD[..., :rot].astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., rot // 2:], x32[..., :rot // 2]], axis=-1)
    out = (x32 * cos + rotated * sin).astype(x_BTHD.dtype)
    return out if rot == x_BTHD.shape[-1] else jnp.concatenate([out, x_BTHD[..., rot:]], axis=-1)
