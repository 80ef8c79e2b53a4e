"""Decoder building blocks: RMSNorm, rotary embeddings, attention with a KV cache, gated MLP.

Every parameter is an ``nnx.Param`` carrying ``logical_axes`` metadata (one
name per dimension); ``rlhf_jax.parallel`` maps those names to mesh axes.
Shapes in comments: B batch, T query length, S key length, E embed, H query
heads, K kv heads, G = H // K, D head_dim, F mlp width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlhf_jax.models.attention import attention
from rlhf_jax.models.decode_attention import decode_attention
from rlhf_jax.models import lora_layers
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.models.rope import apply_rope, rotary_cos_sin
from rlhf_jax.models.sequence_split import constrain

_INIT_STD = 0.02


def param(rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype, init: str = "normal") -> nnx.Param:
    """A parameter with its logical axis names; ``init`` is normal(0.02), ones or zeros."""
    assert len(shape) == len(axes), (shape, axes)
    if init == "normal":
        value = _INIT_STD * jax.random.normal(rngs.params(), shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = jnp.zeros(shape, dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
    """RMSNorm computed in float32, scaled in the input dtype (as transformers does).

    ``unit_offset`` (Gemma): the scale is 1 + weight, applied in float32 before the cast, as Gemma's norm does.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype, unit_offset: bool = False, rngs: nnx.Rngs | None = None):
        # a (1 + w) norm starts at w = 0, the identity scale, as the ones of a plain norm do
        self.weight = param(rngs, (dim,), ("norm",), param_dtype, init="zeros" if unit_offset else "ones")
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, self.unit_offset)


def norm(cfg: ModelConfig, dim: int, rngs: nnx.Rngs | None) -> RMSNorm:
    """The family's RMSNorm over ``dim`` features."""
    return RMSNorm(dim, cfg.rms_norm_eps, param_dtype=cfg.param_dtype, unit_offset=cfg.norm_unit_offset, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, window: int | None = None, rngs: nnx.Rngs | None):
        E, H, K, D, pd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.param_dtype
        if H % K:
            raise ValueError(f"num_attention_heads ({H}) must be a multiple of num_key_value_heads ({K})")
        self.cfg = cfg
        self.window = window  # sliding window (None: full causal attention)
        self.rope = cfg.local_rope if window is not None and cfg.local_rope is not None else cfg.rope
        self.q_proj = param(rngs, (E, H, D), ("embed", "heads", "head_dim"), pd)
        self.k_proj = param(rngs, (E, K, D), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = param(rngs, (E, K, D), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = param(rngs, (H, D, E), ("heads", "head_dim", "embed"), pd)
        if cfg.qkv_bias:
            self.q_bias = param(rngs, (H, D), ("heads", "head_dim"), pd, init="zeros")
            self.k_bias = param(rngs, (K, D), ("kv_heads", "head_dim"), pd, init="zeros")
            self.v_bias = param(rngs, (K, D), ("kv_heads", "head_dim"), pd, init="zeros")
        if cfg.o_bias:
            self.o_bias = param(rngs, (E,), ("embed",), pd, init="zeros")
        if cfg.qk_norm:
            self.q_norm = norm(cfg, D, rngs)
            self.k_norm = norm(cfg, D, rngs)
        lora_layers.add_adapters(self, cfg, rngs, {
            "q_proj": ((E,), (H, D), ("embed",), ("heads", "head_dim")),
            "k_proj": ((E,), (K, D), ("embed",), ("kv_heads", "head_dim")),
            "v_proj": ((E,), (K, D), ("embed",), ("kv_heads", "head_dim")),
            "o_proj": ((H, D), (E,), ("heads", "head_dim"), ("embed",))})

    def _project(self, x: jax.Array, name: str) -> jax.Array:
        dt = self.cfg.dtype
        y = jnp.einsum("bte,ehd->bthd", x, getattr(self, f"{name}_proj")[...].astype(dt))
        adapter = lora_layers.low_rank(self, self.cfg, f"{name}_proj", x, 1)
        if adapter is not None:
            y = y + adapter
        if self.cfg.qkv_bias:
            y = y + getattr(self, f"{name}_bias")[...].astype(dt)
        return constrain(y, "batch", "length", "heads" if name == "q" else "kv_heads")

    def __call__(self, x_BTE, positions_BT, key_valid_BS, q_slots_BT, cache=None, cache_index=None, segment_ids_BT=None):
        """Attend from T new tokens; with ``cache`` (k (B, K, D, S), v (B, K, S, D)) write them at slot ``cache_index``.

        ``q_slots_BT=None`` (no cache) is self-attention over the T tokens, query i at slot i.
        ``segment_ids_BT`` (no cache only) confines attention to packed segments (``blockwise.visible``).
        Returns (output (B, T, E), new cache or None).
        """
        cfg, dt = self.cfg, self.cfg.dtype
        q, k, v = self._project(x_BTE, "q"), self._project(x_BTE, "k"), self._project(x_BTE, "v")
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos_sin = rotary_cos_sin(cfg.head_dim, self.rope, positions_BT)
        q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
        B, T, H, D = q.shape
        new_cache = None
        if cache is not None:
            if segment_ids_BT is not None:
                raise ValueError("segment ids are not supported with a KV cache")
            # The cache holds keys (B, K, D, S) and values (B, K, S, D): in the one-token step q.k reduces
            # over D with S minor and p.v over S with D minor, so both vectorise and neither transposes it.
            k_cache, v_cache = cache
            k_cache = jax.lax.dynamic_update_slice_in_dim(
                k_cache, jnp.transpose(k, (0, 2, 3, 1)).astype(k_cache.dtype), cache_index, axis=3)
            v_cache = jax.lax.dynamic_update_slice_in_dim(
                v_cache, jnp.swapaxes(v, 1, 2).astype(v_cache.dtype), cache_index, axis=2)
            new_cache = (k_cache, v_cache)
            if T == 1:
                out = decode_attention(q[:, 0], k_cache, v_cache, q_slots_BT[:, 0], key_valid_BS, dt, self.window,
                                       cfg.attn_scale, cfg.attn_logit_softcap, implementation=cfg.decode_attn_impl,
                                       interpret=cfg.pallas_interpret)[:, None]
                return self._output(out), new_cache
            # A prefill that fills the whole cache from slot 0 is self-attention over the new tokens.
            if not (isinstance(cache_index, int) and cache_index == 0 and k_cache.shape[3] == T):
                k = jnp.transpose(k_cache, (0, 3, 1, 2)).astype(dt)
                v = jnp.swapaxes(v_cache, 1, 2).astype(dt)
            else:
                q_slots_BT = None
        out = attention(q, k, v, q_slots_BT=q_slots_BT, key_valid_BS=key_valid_BS, q_segment_ids_BT=segment_ids_BT,
                        kv_segment_ids_BS=segment_ids_BT, sliding_window=self.window, scale=cfg.attn_scale,
                        softcap=cfg.attn_logit_softcap, implementation=cfg.attn_impl,
                        context_attention=cfg.context_attention)
        return self._output(out), new_cache

    def _output(self, out_BTHD: jax.Array) -> jax.Array:
        dt = self.cfg.dtype
        # One (B, T, H*D) @ (H*D, E) matmul: with two contracted axes XLA:CPU transposed the weight to (D, H, E)
        # on every call (a decode step copied every layer's o_proj).
        B, T, H, D = out_BTHD.shape
        flat = out_BTHD.astype(dt).reshape(B, T, H * D)
        out = flat @ self.o_proj[...].astype(dt).reshape(H * D, -1)
        adapter = lora_layers.low_rank(self, self.cfg, "o_proj", flat, 1, in_shape=(H * D,))
        if adapter is not None:
            out = out + adapter
        if self.cfg.o_bias:
            out = out + self.o_bias[...].astype(dt)
        return constrain(out, "batch", "length")


ACTIVATION_FNS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act silu (SwiGLU) or gelu (GeGLU, Gemma).

    ``width`` (default ``intermediate_size``): Qwen2-MoE's shared expert has a width of its own.
    """

    def __init__(self, cfg: ModelConfig, *, width: int | None = None, rngs: nnx.Rngs | None):
        E, F, pd = cfg.hidden_size, width or cfg.intermediate_size, cfg.param_dtype
        self.cfg = cfg
        self.gate_proj = param(rngs, (E, F), ("embed", "mlp"), pd)
        self.up_proj = param(rngs, (E, F), ("embed", "mlp"), pd)
        self.down_proj = param(rngs, (F, E), ("mlp", "embed"), pd)
        if cfg.mlp_bias:
            self.gate_bias = param(rngs, (F,), ("mlp",), pd, init="zeros")
            self.up_bias = param(rngs, (F,), ("mlp",), pd, init="zeros")
            self.down_bias = param(rngs, (E,), ("embed",), pd, init="zeros")
        lora_layers.add_adapters(self, cfg, rngs, {
            "gate_proj": ((E,), (F,), ("embed",), ("mlp",)), "up_proj": ((E,), (F,), ("embed",), ("mlp",)),
            "down_proj": ((F,), (E,), ("mlp",), ("embed",))})

    def __call__(self, x_BTE: jax.Array) -> jax.Array:
        dt, bias = self.cfg.dtype, self.cfg.mlp_bias
        gate = self._adapted(x_BTE @ self.gate_proj[...].astype(dt), "gate_proj", x_BTE)
        up = self._adapted(x_BTE @ self.up_proj[...].astype(dt), "up_proj", x_BTE)
        if bias:
            gate, up = gate + self.gate_bias[...].astype(dt), up + self.up_bias[...].astype(dt)
        lead = ("batch", "length")[:x_BTE.ndim - 1]  # (B, T, E), or a Mixture-of-Experts layer's (tokens, E)
        hidden = constrain(ACTIVATION_FNS[self.cfg.hidden_act](gate) * up, *lead, "mlp")
        out = self._adapted(hidden @ self.down_proj[...].astype(dt), "down_proj", hidden)
        return constrain(out + self.down_bias[...].astype(dt) if bias else out, *lead)

    def _adapted(self, y, name: str, x):
        """``y`` plus the LoRA path of projection ``name`` from its input ``x`` (``y`` itself without an adapter)."""
        adapter = lora_layers.low_rank(self, self.cfg, name, x, 1)
        return y if adapter is None else y + adapter
