"""FLOPs and HBM bytes from a model's shape: where XLA's cost analysis gives none (GPU) or counts a loop's body once
(the sampler's decode loops, padded passes that loop over micro-batches).

Counted: every matmul with its parameters (2 FLOPs per multiply-add), attention scores and values (4 x heads x
head_dim per query-key pair); a Mixture-of-Experts layer counts its router and the top-k experts a token uses.
Not counted: norms, activations, softmax, RoPE (a few % of a decoder's FLOPs).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a ``models.ModelConfig``."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    mlp_width: int
    experts: int
    experts_per_token: int
    expert_width: int
    shared_expert_width: int
    sparse_layers: tuple[bool, ...]

    @classmethod
    def of(cls, cfg) -> "ModelShape":
        sparse = tuple(cfg.sparse_layers) or (False,) * cfg.num_hidden_layers
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.head_dim, cfg.vocab_size, cfg.intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                   cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, sparse)

    def active_matmul_params(self) -> int:
        """Parameters one token multiplies with in a forward pass (embedding lookup excluded, output head included)."""
        d = self.hidden
        attention = d * self.heads * self.head_dim * 2 + d * self.kv_heads * self.head_dim * 2
        dense = 3 * d * self.mlp_width
        sparse = d * self.experts + 3 * d * self.expert_width * self.experts_per_token + 3 * d * self.shared_expert_width
        layers = sum(attention + (sparse if s else dense) for s in self.sparse_layers)
        return layers + d * self.vocab

    def total_params(self) -> int:
        """Parameters of the model: every expert counted, the embedding and the output head both."""
        d = self.hidden
        attention = d * self.heads * self.head_dim * 2 + d * self.kv_heads * self.head_dim * 2
        sparse = d * self.experts + 3 * d * (self.expert_width * self.experts + self.shared_expert_width)
        layers = sum(attention + (sparse if s else 3 * d * self.mlp_width) for s in self.sparse_layers)
        return layers + 2 * d * self.vocab

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of keys and values one cached token takes over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


def forward_flops(shape: ModelShape, tokens: int, attended: float) -> float:
    """A forward pass over ``tokens`` tokens, each attending to ``attended`` keys on average."""
    attention = 4.0 * tokens * attended * shape.layers * shape.heads * shape.head_dim
    return 2.0 * tokens * shape.active_matmul_params() + attention


def sequence_flops(shape: ModelShape, sequences: int, length: int) -> float:
    """A causal forward over ``sequences`` sequences of ``length`` tokens (a query attends to half the sequence)."""
    return forward_flops(shape, sequences * length, (length + 1) / 2)


def training_multiplier(remat: str) -> float:
    """Forward + backward as multiples of a forward: the backward costs two, full rematerialization one more."""
    return 4.0 if remat == "full" else 3.0


@dataclasses.dataclass(frozen=True)
class DecodeWork:
    """The sampler's work for one rollout, with every response running to its full length (an upper bound)."""

    prefill_flops: float
    decode_steps: int
    step_flops: float  # one decode step of all slots
    step_bytes_per_device: float  # weights + the KV cache one device reads in a decode step


def decode_work(shape: ModelShape, *, prompts: int, prompt_len: int, n: int, response_len: int, slots: int,
                weight_bytes_per_device: float, cache_itemsize: int, slots_per_device: float,
                length_split: int = 1) -> DecodeWork:
    """Prefill of every prompt once, then ``prompts * n`` samples of ``response_len`` tokens decoded in ``slots``
    slots; a decode step reads the weights and its slots' whole cache (prompt + response columns), of which each
    device holds 1 / ``length_split`` of the columns (the context split)."""
    width = -(-(prompt_len + response_len - 1) // length_split) * length_split
    steps = -(-prompts * n * response_len // slots)
    cache = slots_per_device * width / length_split * shape.kv_bytes_per_token(cache_itemsize)
    return DecodeWork(prefill_flops=sequence_flops(shape, prompts, prompt_len), decode_steps=steps,
                      step_flops=forward_flops(shape, slots, width), step_bytes_per_device=weight_bytes_per_device + cache)
