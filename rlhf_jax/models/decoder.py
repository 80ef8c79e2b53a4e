"""The decoder layer, the decoder backbone and its three heads: causal LM, sequence score (reward model), token value (critic).

Calling conventions (all int32 inputs of shape (B, T), left padding allowed; ``CausalLM`` and
``TokenValueModel`` also take ``positions=None, segment_ids=None``, see packing below):

- ``CausalLM(input_ids, attention_mask=None) -> logits`` float32 (B, T, vocab).
- ``SequenceClassifier(input_ids, attention_mask=None) -> scores`` float32 (B, num_labels),
  read at the last non-pad token as transformers' ``*ForSequenceClassification`` does.
- ``TokenValueModel(input_ids, attention_mask=None) -> values`` float32 (B, T), one scalar
  per token (``*ForTokenClassification`` with one label, the critic layout verl uses).

Position ids follow from the mask (``cumsum(mask) - 1``). For sampling, ``CausalLM``
also runs incrementally over a preallocated KV cache (``init_cache`` / ``forward_cached``).

Sequence packing: ``segment_ids`` (B, T) int32 numbers the sequences packed in a row
(1, 2, ...; 0 is padding). Attention is then causal within the row and confined to
equal non-zero segments, except that responses packed after one shared prompt also see
it (segment ids ``unit << BRANCH_BITS | branch``, see ``rlhf_jax.batch.packing``);
``positions`` should restart at 0 for each sequence (by default they do, for segments
that are contiguous runs), and ``attention_mask`` may be omitted (it is ``segment_ids > 0``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlhf_jax.models.config import TASK_CAUSAL_LM, TASK_CAUSAL_LM_VALUE, TASK_SEQ_CLS, TASK_TOKEN_VALUE, ModelConfig
from rlhf_jax.models.attention import soft_cap
from rlhf_jax.models.layers import MLP, Attention, norm, param
from rlhf_jax.models.moe import SparseMoeBlock
from rlhf_jax.models.remat import after, checkpointed
from rlhf_jax.models.sequence_split import shards_weights, split_length

KVCache = list  # one (k, v) pair per layer: k (B, K, D, S), v (B, K, S, D) (K kv heads, S slots)


def positions_from_mask(attention_mask_BT: jax.Array) -> jax.Array:
    """Position ids for a left-padded batch: 0 at the first real token; pads get 0."""
    return jnp.maximum(jnp.cumsum(attention_mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def positions_from_segments(segment_ids_BT: jax.Array) -> jax.Array:
    """Position ids restarting at 0 wherever the segment id changes (packed contiguous sequences)."""
    T = segment_ids_BT.shape[1]
    idx = jnp.broadcast_to(jnp.arange(T), segment_ids_BT.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], bool),
                              segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block; with ``sandwich_norms`` (Gemma) the attention and MLP outputs are normed too."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, *, rngs: nnx.Rngs | None):
        E = cfg.hidden_size
        self.input_layernorm = norm(cfg, E, rngs)
        self.self_attn = Attention(cfg, window=cfg.window_of(layer), rngs=rngs)
        # Llama: the norm before the MLP. Gemma: the attention output's norm (transformers' names both ways).
        self.post_attention_layernorm = norm(cfg, E, rngs)
        self.sparse = cfg.is_sparse(layer)
        self.mlp = SparseMoeBlock(cfg, rngs=rngs) if self.sparse else MLP(cfg, rngs=rngs)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(cfg, E, rngs)
            self.post_feedforward_layernorm = norm(cfg, E, rngs)

    def __call__(self, x_BTE, positions_BT, key_valid_BS, q_slots_BT, cache=None, cache_index=None, segment_ids_BT=None,
                 routes_BTK=None):
        """(output, new cache); a sparse layer returns (output, new cache, RouterStats or None, expert ids (B, T, K)),
        the statistics over the real tokens of a whole-sequence pass (``key_valid_BS`` is then the (B, T) token
        mask), the ids those its router chose or ``routes_BTK`` replayed (see ``moe``)."""
        attn, new_cache = self.self_attn(
            self.input_layernorm(x_BTE), positions_BT, key_valid_BS, q_slots_BT, cache, cache_index, segment_ids_BT
        )
        if self.sparse:  # Qwen MoE families: pre-norm, no sandwich norms
            x_BTE = x_BTE + attn
            out, stats, ids = self.mlp(self.post_attention_layernorm(x_BTE), key_valid_BS if cache is None else None,
                                       routes_BTK)
            return x_BTE + out, new_cache, stats, ids
        if not self.sandwich:
            x_BTE = x_BTE + attn
            return x_BTE + self.mlp(self.post_attention_layernorm(x_BTE)), new_cache
        x_BTE = x_BTE + self.post_attention_layernorm(attn)
        return x_BTE + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x_BTE))), new_cache


def _checkpointed_layer(layer: DecoderLayer, policy: str, record: bool, x_BTE, *args) -> jax.Array:
    """``layer(x, *args)`` whose activations are recomputed in the backward pass as ``policy`` says; a sparse
    layer's output also holds its router statistics, and with ``record`` its expert ids.

    The checkpoint wraps a pure function of the layer's state (split here, merged inside) rather
    than ``nnx.remat`` on the module: the module's variables may belong to an outer trace (a model
    merged outside ``lax.map`` or ``value_and_grad``), and nnx refuses to touch them from the inner one.
    """
    graphdef, state = nnx.split(layer)

    def run(state, x, *args):
        # On a mesh, the layer's weights are read (cast, and gathered where sharded) only once its input exists:
        # otherwise XLA may start every layer's gathers at once, holding all the gathered weights (FSDP on TPU:
        # ~0.6 GiB per 7B layer). On one device there is nothing to gather, and the added zero cost ~6 % of a step.
        out = nnx.merge(graphdef, after(state, x) if shards_weights() else state)(x, *args)
        if not layer.sparse:
            return out[0]
        return (out[0], out[2], out[3]) if record else (out[0], out[2])

    return checkpointed(run, policy)(state, x_BTE, *args)


class Decoder(nnx.Module):
    """Token embedding, the stack of decoder layers and the final norm."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None):
        self.cfg = cfg
        self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = norm(cfg, cfg.hidden_size, rngs)

    def __call__(self, input_ids_BT, positions_BT, key_valid_BS, q_slots_BT, cache=None, cache_index=None,
                 segment_ids_BT=None, with_router_stats=False, routes_BTLK=None, record_routes=False):
        """Hidden states (B, T, E) and the new cache (None without one), then what was asked for:

        ``q_slots_BT=None`` (no cache): self-attention over the T tokens, query i at slot i.
        ``with_router_stats`` (no cache): the ``moe.RouterStats`` summed over the sparse layers (None
        for a dense model) over the tokens where ``key_valid_BS`` (then the (B, T) token mask) holds.
        ``record_routes``: the expert ids every sparse layer used, (B, T, sparse layers, K) int32.
        ``routes_BTLK`` (no cache): recorded ids the sparse layers replay (``moe.route``; -1 rows route natively).
        """
        table = self.embed_tokens[...]
        x = jnp.take(table, input_ids_BT, axis=0)
        if self.cfg.embedding_scale != 1.0:  # in the table's dtype, as transformers scales it
            x = x * jnp.asarray(self.cfg.embedding_scale, table.dtype)
        x = x.astype(self.cfg.dtype)
        recorded = []
        if cache is None:  # a whole-sequence pass: under a context split, tokens stay split along T between layers
            x, positions_BT, key_valid_BS = split_length(x), split_length(positions_BT), split_length(key_valid_BS)
            segment_ids_BT = None if segment_ids_BT is None else split_length(segment_ids_BT)
            stats = None
            sparse_index = 0
            for layer in self.layers:
                routes = None
                if layer.sparse and routes_BTLK is not None:
                    routes = routes_BTLK[:, :, sparse_index]
                args = (positions_BT, key_valid_BS, q_slots_BT, None, None, segment_ids_BT, routes)
                if self.cfg.remat == "none":
                    out = layer(x, *args)
                    out = (out[0], out[2], out[3]) if layer.sparse else (out[0],)
                else:
                    out = _checkpointed_layer(layer, self.cfg.remat, record_routes, x, *args)
                    out = out if layer.sparse else (out,)
                x = split_length(out[0])
                if layer.sparse:
                    sparse_index += 1
                    stats = out[1] if stats is None else stats + out[1]
                    if record_routes:
                        recorded.append(out[2])
            result = (self.norm(x), None) + ((stats,) if with_router_stats else ())
        else:
            new_cache = []
            for layer, layer_cache in zip(self.layers, cache):
                out = layer(x, positions_BT, key_valid_BS, q_slots_BT, layer_cache, cache_index)
                x = out[0]
                new_cache.append(out[1])
                if layer.sparse and record_routes:
                    recorded.append(out[3])
            result = (self.norm(x), new_cache)
        return result + ((jnp.stack(recorded, axis=2),) if record_routes else ())

    def full_sequence(self, input_ids_BT, attention_mask_BT=None, positions_BT=None, segment_ids_BT=None,
                      with_router_stats=False, routes_BTLK=None, record_routes=False):
        """Hidden states (B, T, E) of whole sequences, no cache: left-padded rows, or packed rows with segment ids.
        ``with_router_stats`` / ``record_routes``: (hidden states, RouterStats or None, / the expert ids used)."""
        if segment_ids_BT is not None:
            mask = segment_ids_BT > 0 if attention_mask_BT is None else attention_mask_BT
            positions = positions_from_segments(segment_ids_BT) if positions_BT is None else positions_BT
        else:
            mask = jnp.ones(input_ids_BT.shape, jnp.int32) if attention_mask_BT is None else attention_mask_BT
            positions = positions_from_mask(mask) if positions_BT is None else positions_BT
        out = self(input_ids_BT, positions, mask, None, segment_ids_BT=segment_ids_BT,
                   with_router_stats=with_router_stats, routes_BTLK=routes_BTLK, record_routes=record_routes)
        return out[0] if len(out) == 2 else (out[0],) + out[2:]


class CausalLM(nnx.Module):
    task = TASK_CAUSAL_LM

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None):
        self.config = cfg
        self.model = Decoder(cfg, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype)

    def unembedding(self) -> jax.Array:
        """The (E, vocab) output projection (the transposed embedding when tied)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens[...].T
        return self.lm_head[...]

    def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
        logits = (hidden @ self.unembedding().astype(self.config.dtype)).astype(jnp.float32)
        return soft_cap(logits, self.config.final_logit_softcap)

    def hidden_states(self, input_ids, attention_mask=None, positions=None, segment_ids=None, with_router_stats=False,
                      routes=None, record_routes=False):
        """(B, T, E) hidden states; ``with_router_stats``: (hidden states, moe.RouterStats or None for a dense model);
        ``routes`` (B, T, sparse layers, K): expert ids to replay; ``record_routes``: also the ids used."""
        return self.model.full_sequence(input_ids, attention_mask, positions, segment_ids, with_router_stats, routes,
                                        record_routes)

    def __call__(self, input_ids, attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
        return self.logits_from_hidden(self.hidden_states(input_ids, attention_mask, positions, segment_ids))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        cfg = self.config
        k_shape = (batch, cfg.num_key_value_heads, cfg.head_dim, max_len)
        v_shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        dtype = dtype or cfg.dtype
        return [(jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)) for _ in range(cfg.num_hidden_layers)]

    def forward_cached(self, input_ids_BT, positions_BT, key_valid_BS, cache: KVCache, cache_index,
                       record_routes=False):
        """Run T new tokens written at cache slots [cache_index, cache_index + T).

        ``key_valid_BS`` marks which of the S cache slots hold real tokens (after this
        write). Returns (hidden (B, T, E), new cache); ``logits_from_hidden`` gives logits.
        ``record_routes``: also the expert ids of the T tokens (B, T, sparse layers, K).
        """
        B, T = input_ids_BT.shape
        q_slots = jnp.broadcast_to(cache_index + jnp.arange(T), (B, T))
        return self.model(input_ids_BT, positions_BT, key_valid_BS, q_slots, cache, cache_index,
                          record_routes=record_routes)


def last_token_index(attention_mask_BT: jax.Array) -> jax.Array:
    """Index of the rightmost real token of each row (the pooling position of a score head)."""
    T = attention_mask_BT.shape[1]
    return jnp.max(jnp.where(attention_mask_BT.astype(bool), jnp.arange(T)[None, :], 0), axis=1)


class SequenceClassifier(nnx.Module):
    task = TASK_SEQ_CLS

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None):
        self.config = cfg
        self.model = Decoder(cfg, rngs=rngs)
        self.score = param(rngs, (cfg.hidden_size, cfg.num_labels), ("embed", "labels"), cfg.param_dtype)

    def __call__(self, input_ids, attention_mask=None, positions=None) -> jax.Array:
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        hidden = self.model.full_sequence(input_ids, attention_mask, positions)
        pooled = jnp.take_along_axis(hidden, last_token_index(attention_mask)[:, None, None], axis=1)[:, 0]
        return (pooled @ self.score[...].astype(self.config.dtype)).astype(jnp.float32)


class TokenValueModel(nnx.Module):
    task = TASK_TOKEN_VALUE

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None):
        self.config = cfg
        self.model = Decoder(cfg, rngs=rngs)
        self.score = param(rngs, (cfg.hidden_size, 1), ("embed", "labels"), cfg.param_dtype)
        self.score_bias = param(rngs, (1,), ("labels",), cfg.param_dtype, init="zeros")

    def values_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """(..., E) hidden states -> (...) float32 values."""
        dt = self.config.dtype
        values = hidden @ self.score[...].astype(dt) + self.score_bias[...].astype(dt)
        return values[..., 0].astype(jnp.float32)

    def token_values(self, input_ids, attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
        """(B, T) float32 value of each position."""
        return self.values_from_hidden(self.model.full_sequence(input_ids, attention_mask, positions, segment_ids))

    __call__ = token_values


class CausalLMWithValue(CausalLM):
    """A causal LM with a value head on its trunk (seed 000's ``actor_critic``): log-probs and values come from one
    forward pass (``hidden_states``, then ``logits_from_hidden`` and ``values_from_hidden``)."""

    task = TASK_CAUSAL_LM_VALUE

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None):
        super().__init__(cfg, rngs=rngs)
        self.score = param(rngs, (cfg.hidden_size, 1), ("embed", "labels"), cfg.param_dtype)
        self.score_bias = param(rngs, (1,), ("labels",), cfg.param_dtype, init="zeros")

    values_from_hidden = TokenValueModel.values_from_hidden

    def token_values(self, input_ids, attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
        return self.values_from_hidden(self.hidden_states(input_ids, attention_mask, positions, segment_ids))


MODEL_CLASSES = {TASK_CAUSAL_LM: CausalLM, TASK_SEQ_CLS: SequenceClassifier, TASK_TOKEN_VALUE: TokenValueModel,
                 TASK_CAUSAL_LM_VALUE: CausalLMWithValue}
