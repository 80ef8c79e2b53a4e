"""The correspondence between our parameter paths and Hugging Face tensor names and layouts.

HF linear weights are (out_features, in_features); ours are (in dims..., out dims...)
with heads split out, e.g. q_proj (E, H, D) and o_proj (H, D, E). So every linear is
``ours = hf.T.reshape(our_shape)`` and ``hf = ours.reshape(in, out).T``; biases,
norms and the embedding table are reshaped copies.

Some families fuse projections into one HF tensor (Phi-3: ``qkv_proj``, ``gate_up_proj``);
each of our separate projections is then a block of that tensor's output rows.

Mixture-of-Experts checkpoints store each expert's projections as separate tensors
(``mlp.experts.{e}.gate_proj.weight``, the layout transformers writes and older versions read);
ours stack them on a leading expert axis, so one of our parameters is ``experts`` HF tensors.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# Our leaf names that are linear weights, with how many leading dims are input dims.
_LINEAR_INPUT_DIMS = {
    "q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2,
    "gate_proj": 1, "up_proj": 1, "down_proj": 1,
    "lm_head": 1, "score": 1,
    "gate": 1, "shared_expert_gate": 1,  # MoE router, Qwen2-MoE's shared-expert gate
}


@dataclasses.dataclass(frozen=True)
class TensorMapping:
    hf_name: str
    linear_input_dims: int  # 0 = plain reshape copy
    rows: tuple[int, int, int] | None = None  # (first, end, total): our block of a fused HF tensor's rows
    experts: int = 0  # > 0: our leading axis stacks this many HF tensors, named by ``hf_name.format(e)``

    def hf_names(self) -> list[str]:
        """The HF tensor(s) of this parameter: one, or one per expert."""
        return [self.hf_name.format(e) for e in range(self.experts)] if self.experts else [self.hf_name]

    def expert(self, e: int) -> "TensorMapping":
        """The mapping of expert ``e``'s slice of a stacked parameter."""
        return dataclasses.replace(self, hf_name=self.hf_name.format(e), experts=0)

    def block(self, hf: np.ndarray) -> np.ndarray:
        """Our rows of the HF tensor (all of it unless fused); a fused tensor must have exactly ``total`` rows."""
        if self.rows is None:
            return hf
        first, end, total = self.rows
        if hf.shape[0] != total:
            raise ValueError(f"fused tensor {self.hf_name} has {hf.shape[0]} rows, config.json implies {total}")
        return hf[first:end]

    def to_ours(self, hf: np.ndarray, our_shape: tuple[int, ...]) -> np.ndarray:
        if self.linear_input_dims:
            return np.asarray(hf).T.reshape(our_shape)
        return np.asarray(hf).reshape(our_shape)

    def hf_shape(self, our_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.linear_input_dims:
            n = self.linear_input_dims
            return (math.prod(our_shape[n:]), math.prod(our_shape[:n]))
        if self.hf_name.endswith(".bias") and len(our_shape) == 2:
            return (math.prod(our_shape),)
        return tuple(our_shape)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        shape = self.hf_shape(ours.shape)
        if self.linear_input_dims:
            n = self.linear_input_dims
            return np.ascontiguousarray(ours.reshape(math.prod(ours.shape[:n]), -1).T)
        return np.ascontiguousarray(ours.reshape(shape))


def fused_projections(cfg) -> dict[str, tuple[str, int, int, int]]:
    """Our projections stored as row blocks of one HF tensor: leaf -> (HF leaf, first row, end row, total rows)."""
    if cfg is None or cfg.model_type != "phi3":
        return {}
    q, kv, F = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    qkv = q + 2 * kv
    return {"q_proj": ("qkv_proj", 0, q, qkv), "k_proj": ("qkv_proj", q, q + kv, qkv),
            "v_proj": ("qkv_proj", q + kv, qkv, qkv), "gate_proj": ("gate_up_proj", 0, F, 2 * F),
            "up_proj": ("gate_up_proj", F, 2 * F, 2 * F)}


def mapping_for(path: tuple, cfg=None) -> TensorMapping:
    """The HF tensor for one of our parameter paths, e.g. ('model', 'layers', 0, 'self_attn', 'q_proj');
    ``cfg`` (a ModelConfig) says which projections its family fuses."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    prefix = ".".join(parts[:-1])
    join = (lambda name: f"{prefix}.{name}" if prefix else name)
    fused = fused_projections(cfg).get(leaf)
    if fused:
        name, *rows = fused
        return TensorMapping(join(f"{name}.weight"), _LINEAR_INPUT_DIMS[leaf], tuple(rows))
    if len(parts) > 1 and parts[-2] == "experts" and cfg is not None and cfg.num_experts:
        return TensorMapping(f"{prefix}.{{}}.{leaf}.weight", _LINEAR_INPUT_DIMS[leaf], experts=cfg.num_experts)
    if leaf in _LINEAR_INPUT_DIMS:
        return TensorMapping(join(f"{leaf}.weight"), _LINEAR_INPUT_DIMS[leaf])
    if leaf == "score_bias":
        return TensorMapping(join("score.bias"), 0)
    if leaf.endswith("_bias"):  # q_bias -> q_proj.bias, gate_bias -> gate_proj.bias, o_bias -> o_proj.bias
        return TensorMapping(join(f"{leaf[:-5]}_proj.bias"), 0)
    if leaf == "embed_tokens":
        return TensorMapping(join("embed_tokens.weight"), 0)
    if leaf == "weight":  # norms
        return TensorMapping(join("weight"), 0)
    raise KeyError(f"no Hugging Face name for parameter {'.'.join(parts)}")


# Tensors HF checkpoints may carry that hold no learned state we need.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
