"""Abstract models and roles for a run: shapes, dtypes and shardings from a Hugging Face ``config.json`` alone.

No weight is read and no parameter memory is allocated: every parameter is a ``jax.ShapeDtypeStruct`` carrying the
``NamedSharding`` its logical axes give it on the target mesh, so the programs built over them (train/engine.py
``Role``, rollout/sampler.py ``Sampler``) lower and compile for the target exactly as a run would build them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
from flax import nnx
from ml_collections import ConfigDict

from rlhf_jax import models
from rlhf_jax.models.hub import resolve_model_path
from rlhf_jax.models.hf_import import build_abstract
from rlhf_jax.models.sharding import variable_sharding

# config.json of models one can plan for by name without a download (public values of their Hugging Face repos)
BUNDLED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs")
BUNDLED = {"Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b.json", "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b.json",
           "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b.json"}


def hf_config(path: str) -> dict:
    """The ``config.json`` of a model path: a directory (only config.json is read), a .json file, a bundled Hub id
    (``BUNDLED``), or anything ``resolve_model_path`` resolves (``builtin:tiny``)."""
    if path in BUNDLED:
        path = os.path.join(BUNDLED_DIR, BUNDLED[path])
    elif not path.endswith(".json"):
        path = resolve_model_path(path)
    if os.path.isdir(path):
        return models.load_hf_config(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"actor_rollout_ref.model.path={path!r}: no config.json there (a directory, a "
                                f"config.json file, or one of {', '.join(BUNDLED)})")
    with open(path) as f:
        return json.load(f)


def model_config(cfg: ConfigDict, hf: dict, role: str):
    """The ``ModelConfig`` ``train/setup.load_policy`` builds for ``role`` ("actor", "ref", "critic")."""
    from rlhf_jax.train.setup import DTYPES, lora_spec

    m = cfg.actor_rollout_ref.model
    role_cfg = cfg.critic.model if role == "critic" else m
    remat = role_cfg.remat_policy if role != "ref" and role_cfg.enable_gradient_checkpointing else "none"
    out = models.from_hf_dict(hf, dtype=DTYPES[m.compute_dtype], param_dtype=DTYPES[m.dtype], remat=remat,
                              attn_impl=m.attn_implementation, context_attention=cfg.mesh.context_attention)
    spec = lora_spec(cfg, out) if role == "actor" else None
    if spec is not None:
        out = out.replace(lora=spec)
    return out


def abstract_model(model_cfg, task: str, mesh, rules) -> nnx.Module:
    """The model with every parameter a ``ShapeDtypeStruct`` sharded on ``mesh`` (nothing allocated)."""
    graphdef, state = nnx.split(build_abstract(model_cfg, task))
    flat = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        flat.append((path, var.replace(value=jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                                  sharding=variable_sharding(var, mesh, rules)))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def count_params(tree: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(tree) if hasattr(x, "size"))


def relocated(state: Any, mesh) -> Any:
    """``state`` (abstract) with the same partitioning on another mesh (the rollout devices' copy)."""
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec)),
                        state)
