"""Write a model back as an ordinary Hugging Face directory that ``transformers`` loads unchanged.

Tensors are gathered to the host one at a time (sharded or multi-process arrays
included) and written in safetensors shards of at most ``max_shard_bytes``, with
the index file when there is more than one. Only process 0 writes. The
directory is assembled under a temporary name and renamed into place, so a
crash never leaves a half-written export where a complete one is expected.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from rlhf_jax.parallel import groups
from rlhf_jax.models.config import TASK_CAUSAL_LM_VALUE, TASK_SEQ_CLS, TASK_TOKEN_VALUE, architecture_name
from rlhf_jax.models.hf_names import TensorMapping, mapping_for
from rlhf_jax.models.safetensors_io import save_file

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
# A shared-trunk actor-critic's value head, beside the causal LM, under the names TRL's
# AutoModelForCausalLMWithValueHead gives it (v_head.summary: a Linear(hidden, 1)).
VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_HEAD_NAMES = {"score.weight": "v_head.summary.weight", "score.bias": "v_head.summary.bias"}
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(ml_dtypes.bfloat16): "bfloat16"}


def to_host(x: jax.Array) -> np.ndarray:
    """The full value of a (possibly sharded, possibly multi-process) array on this host."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    return groups.allgather(x, tiled=True)


def hf_config_dict(model: nnx.Module) -> dict:
    cfg = model.config
    hf = {k: v for k, v in cfg.hf_config.items() if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")}
    dtype_name = _DTYPE_NAMES.get(np.dtype(cfg.param_dtype), "float32")
    hf.update(architectures=[architecture_name(cfg.model_type, model.task)], torch_dtype=dtype_name, dtype=dtype_name)
    if model.task == TASK_TOKEN_VALUE:
        hf.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    elif model.task == TASK_SEQ_CLS:
        hf["num_labels"] = cfg.num_labels
    return hf


Part = tuple[TensorMapping, nnx.Variable, "int | None"]  # (mapping, parameter, expert index of a stacked one)


def _hf_tensors(model: nnx.Module) -> list[tuple[str, list[Part]]]:
    """Each HF tensor with the parameters it is made of: one, the row blocks of a fused tensor in row order,
    or one expert's slice of a stacked expert parameter (the experts of one parameter come consecutively)."""
    groups: dict[str, list] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        mapping = mapping_for(path, model.config)
        if mapping.experts:
            for e in range(mapping.experts):
                groups.setdefault(mapping.hf_name.format(e), []).append((mapping.expert(e), var, e))
        else:
            groups.setdefault(mapping.hf_name, []).append((mapping, var, None))
    return [(name, sorted(parts, key=lambda p: p[0].rows or ())) for name, parts in groups.items()]


def _part_bytes(var: nnx.Variable, expert: int | None) -> int:
    shape = var.get_value().shape[(expert is not None):]
    return int(np.prod(shape)) * np.dtype(var.get_value().dtype).itemsize


def _plan_shards(entries: list[tuple[str, list]], max_bytes: int) -> list[list[int]]:
    shards, current, size = [], [], 0
    for i, (_, parts) in enumerate(entries):
        nbytes = sum(_part_bytes(v, e) for _, v, e in parts)
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def save_pretrained(
    model: nnx.Module,
    out_dir: str,
    *,
    tokenizer=None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    copy_from: str | None = None,
) -> str:
    """Export ``model`` to ``out_dir`` (config.json, safetensors, tokenizer files when given).

    ``copy_from``: a source HF directory whose generation_config.json and chat template are copied.
    """
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    writer = groups.current().is_first
    entries = _hf_tensors(model)
    value_head = [e for e in entries if e[0] in VALUE_HEAD_NAMES] if model.task == TASK_CAUSAL_LM_VALUE else []
    entries = [e for e in entries if e not in value_head]
    shards = _plan_shards(entries, max_shard_bytes)
    tmp_dir = out_dir + ".tmp-export"
    if writer:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir)
    weight_map: dict[str, str] = {}
    total = 0
    last: dict = {}  # the most recently gathered stacked parameter: its experts are written one after another

    def host_value(var: nnx.Variable, expert: int | None) -> np.ndarray:
        if expert is None:
            return to_host(var.get_value())
        if last.get("var") is not var:
            last.update(var=var, value=to_host(var.get_value()))
        return last["value"][expert]

    for k, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for i in shard:
            name, parts = entries[i]
            blocks = [mapping.to_hf(host_value(var, e)) for mapping, var, e in parts]  # every process gathers
            tensors[name] = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=0)
            weight_map[name] = fname
            total += tensors[name].nbytes
        if writer:
            save_file(tensors, os.path.join(tmp_dir, fname))
    head = {VALUE_HEAD_NAMES[name]: parts[0][0].to_hf(host_value(parts[0][1], None)) for name, parts in value_head}
    if not writer:
        return out_dir
    if head:
        save_file(head, os.path.join(tmp_dir, VALUE_HEAD_FILE))
    if len(shards) > 1:
        with open(os.path.join(tmp_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(tmp_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(model), f, indent=2, sort_keys=True)
    if copy_from:
        for name in ("generation_config.json", "chat_template.jinja", "chat_template.json"):
            src = os.path.join(copy_from, name)
            if os.path.exists(src):
                shutil.copy(src, tmp_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp_dir)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp_dir, out_dir)
    return out_dir
