"""Load a local Hugging Face checkpoint directly into its sharded layout on a mesh.

The model is first built abstractly (``nnx.eval_shape``: no memory), then each
parameter is read from the memory-mapped safetensors file(s), converted to our
layout on the host one tensor at a time, and placed with
``jax.make_array_from_callback`` so each device receives only its own shard.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlhf_jax.models.config import (
    TASK_CAUSAL_LM,
    TASKS,
    ModelConfig,
    UnsupportedModelError,
    from_hf_dict,
    load_hf_config,
    task_from_hf,
)
from rlhf_jax.models.decoder import MODEL_CLASSES
from rlhf_jax.models.hf_names import IGNORED_HF_SUFFIXES, mapping_for
from rlhf_jax.models.safetensors_io import LazyFile
from rlhf_jax.models.sharding import variable_sharding
from rlhf_jax.parallel.mesh import DEFAULT_RULES, Rules, single_device_mesh

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing weights or holds tensors that do not fit the model."""


class CheckpointReader:
    """Name -> tensor access over a single or sharded (indexed) safetensors checkpoint."""

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, INDEX_FILE)
        single_path = os.path.join(path, SINGLE_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = {fname: None for fname in weight_map.values()}
            for fname in files:
                if not os.path.exists(os.path.join(path, fname)):
                    raise CheckpointError(f"{index_path} lists {fname}, which does not exist")
            self._files = {fname: LazyFile(os.path.join(path, fname)) for fname in files}
            self._where = dict(weight_map)
        elif os.path.exists(single_path):
            self._files = {SINGLE_FILE: LazyFile(single_path)}
            self._where = {name: SINGLE_FILE for name in self._files[SINGLE_FILE].keys()}
        else:
            present = sorted(os.listdir(path))
            raise CheckpointError(
                f"no weights in {path!r}: expected {SINGLE_FILE} or {INDEX_FILE} "
                f"(only safetensors checkpoints are supported); found {present}"
            )

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> np.ndarray:
        return self._files[self._where[name]].get(name)


def build_abstract(cfg: ModelConfig, task: str) -> nnx.Module:
    if task not in TASKS:
        raise ValueError(f"unknown model task {task!r}; expected one of {TASKS}")
    return nnx.eval_shape(lambda: MODEL_CLASSES[task](cfg, rngs=nnx.Rngs(0)))


def init_model(cfg: ModelConfig, task: str = TASK_CAUSAL_LM, *, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES, seed: int = 0) -> nnx.Module:
    """A randomly initialised model with its parameters created directly in their sharded layout."""
    mesh = mesh or single_device_mesh()
    abstract = build_abstract(cfg, task)
    _, abs_state = nnx.split(abstract)
    shardings = jax.tree.map(
        lambda v: variable_sharding(v, mesh, rules), abs_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )

    def make():
        return nnx.state(MODEL_CLASSES[task](cfg, rngs=nnx.Rngs(seed)))

    state = jax.jit(make, out_shardings=shardings)()
    graphdef, _ = nnx.split(abstract)
    return nnx.merge(graphdef, state)


def _fresh_head(shape, dtype, seed: int) -> np.ndarray:
    """A small random head for a task the checkpoint does not carry (e.g. a critic from a causal LM)."""
    rng = np.random.default_rng(seed)
    return (0.02 * rng.standard_normal(shape)).astype(dtype)


def _read(reader: CheckpointReader, mapping, shape: tuple[int, ...], path: str) -> np.ndarray:
    """One HF tensor (or our block of a fused one) in our layout of ``shape``, its shape checked."""
    try:
        hf_tensor = mapping.block(reader.get(mapping.hf_name))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    expected = mapping.hf_shape(shape)
    if tuple(hf_tensor.shape) != expected:
        raise CheckpointError(
            f"{path}: tensor {mapping.hf_name} has shape {tuple(hf_tensor.shape)}, but config.json implies {expected}"
        )
    return mapping.to_ours(hf_tensor, shape)


def from_pretrained(
    path: str,
    *,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    dtype=jnp.float32,
    param_dtype=None,
    task: str | None = None,
    remat: bool | str = "none",
    attn_impl: str = "auto",
    context_attention: str = "auto",
    seed: int = 0,
) -> nnx.Module:
    """Load a local HF directory (``*ForCausalLM``, ``*ForSequenceClassification`` or
    ``*ForTokenClassification``) as a model whose parameters live sharded on ``mesh``.

    ``task`` overrides the head read from ``architectures``: ``"token_value"`` on a causal-LM
    checkpoint builds a critic whose value head is freshly initialised (as verl does).
    ``remat`` is a policy name ("none", "full", "dots_saveable") or a bool ("full" / "none");
    ``attn_impl`` picks the attention implementation (see ``models/attention.py``), ``context_attention`` how it
    runs under a sequence split (mesh.context_attention).
    """
    path = os.path.expanduser(path)
    hf = load_hf_config(path)
    try:
        cfg = from_hf_dict(hf, dtype=dtype, param_dtype=param_dtype or dtype, remat=remat, attn_impl=attn_impl,
                           context_attention=context_attention)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path}: {e} (architectures {hf.get('architectures')})") from None
    checkpoint_task = task_from_hf(hf)
    task = task or checkpoint_task
    reader = CheckpointReader(path)
    mesh = mesh or single_device_mesh()

    abstract = build_abstract(cfg, task)
    graphdef, state = nnx.split(abstract)
    available = reader.names()
    consumed: set[str] = set()
    missing: list[str] = []
    for var_path, var in nnx.to_flat_state(state):
        mapping = mapping_for(var_path, cfg)
        shape, target_dtype = tuple(var.get_value().shape), var.get_value().dtype
        names = mapping.hf_names()
        if all(name in available for name in names):
            if mapping.experts:  # one HF tensor per expert, stacked on our leading axis
                host = np.stack([_read(reader, mapping.expert(e), shape[1:], path) for e in range(mapping.experts)])
            else:
                host = _read(reader, mapping, shape, path)
            host = host.astype(target_dtype)
            consumed.update(names)
        elif task != checkpoint_task and var_path[0] in ("score", "score_bias"):
            host = (np.zeros(shape) if var_path[0] == "score_bias" else _fresh_head(shape, np.float32, seed)).astype(target_dtype)
        else:
            missing.extend(name for name in names if name not in available)
            continue
        sharding = variable_sharding(var, mesh, rules)
        var.set_value(jax.make_array_from_callback(shape, sharding, lambda idx, h=host: h[idx]))
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks tensors the model needs: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    leftover = sorted(
        n for n in available - consumed
        if not n.endswith(IGNORED_HF_SUFFIXES) and not (n == "lm_head.weight" and (cfg.tie_word_embeddings or task != TASK_CAUSAL_LM))
    )
    if leftover:
        log.warning("%s: ignoring %d tensors the model does not use: %s", path, len(leftover), leftover[:8])
    return nnx.merge(graphdef, state)
