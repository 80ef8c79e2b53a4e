"""Export any saved training step as a Hugging Face directory.

    python -m rlhf_jax.export --checkpoint CKPT_DIR --out OUT_DIR [--step N]

``CKPT_DIR`` is a run's checkpoint root (``<trainer.default_local_dir>/checkpoints``,
whose latest complete step is used unless ``--step`` says otherwise) or one step's
directory (``.../checkpoints/<step>``). Only the actor's parameters are read; the
model is rebuilt from the config.json stored with the checkpoint, and the
tokenizer is copied from the directory the run used. A LoRA run's model is written with
its adapters merged in, and the adapter alone in PEFT's layout under ``OUT_DIR/lora_adapter``; its
checkpoints hold only the adapters, so the base model directory the run used must still exist.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from rlhf_jax.config.names import DTYPES
from rlhf_jax.models import lora
from rlhf_jax.models.config import from_hf_dict
from rlhf_jax.models.lora_peft import ADAPTER_DIR, save_adapter
from rlhf_jax.models.hf_export import save_pretrained
from rlhf_jax.models.hf_import import build_abstract, from_pretrained
from rlhf_jax.parallel.mesh import single_device_mesh
from rlhf_jax.runtime.checkpoint import Checkpointer

_DTYPES = {name: getattr(jnp, name) for name in DTYPES}


def locate(checkpoint: str, step: int | None) -> tuple[str, int]:
    """(checkpoint root, step) for a root or a step directory."""
    path = os.path.abspath(os.path.expanduser(checkpoint))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--checkpoint {path!r} does not exist")
    base = os.path.basename(path.rstrip("/"))
    if base.isdigit() and step is None:
        return os.path.dirname(path), int(base)
    ckpt = Checkpointer(path, async_save=False, read_only=True)
    steps = ckpt.all_steps()
    ckpt.close()
    if not steps:
        raise FileNotFoundError(f"{path!r} holds no complete checkpoint")
    if step is None:
        return path, max(steps)
    if step not in steps:
        raise FileNotFoundError(f"{path!r} has no step {step}; saved steps: {sorted(steps)}")
    return path, step


def export(checkpoint: str, out_dir: str, step: int | None = None) -> str:
    root, step = locate(checkpoint, step)
    ckpt = Checkpointer(root, async_save=False, read_only=True)
    extra = ckpt.restore_extra(step)
    info = extra["model"]
    dtype = _DTYPES[info.get("param_dtype", "float32")]
    cfg = from_hf_dict(info["hf_config"], dtype=dtype, param_dtype=dtype)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    as_template = lambda state: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)
    if info.get("lora"):  # the checkpoint holds the adapters (and a value head); the base is read from the base model
        model = _lora_base(info, dtype)
        graphdef, adapters, base = nnx.split(model, lora.trained_filter, ...)
        adapters = ckpt.restore_arrays(step, {"actor_params": as_template(adapters)})["actor_params"]
        model = nnx.merge(graphdef, adapters, base)
    else:
        graphdef, abs_state = nnx.split(build_abstract(cfg, info["task"]))
        params = ckpt.restore_arrays(step, {"actor_params": as_template(abs_state)})["actor_params"]
        model = nnx.merge(graphdef, params)
    ckpt.close()
    tokenizer = None
    tok_path = info.get("tokenizer_path")
    if tok_path and os.path.isdir(tok_path):
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(tok_path)
    out = save_pretrained(lora.merged_model(model), out_dir, tokenizer=tokenizer, copy_from=tok_path)
    if model.config.lora is not None:
        save_adapter(model, os.path.join(out, ADAPTER_DIR), base_model=info.get("base_model_path"))
    return out


def _lora_base(info: dict, dtype):
    """The run's base model (``base_model_path``) with adapters of its rank, alpha and targets, on one device."""
    spec = info["lora"]
    base_path = info.get("base_model_path")
    if not base_path or not os.path.isfile(os.path.join(base_path, "config.json")):
        raise FileNotFoundError(f"the LoRA run's base model {base_path!r} is not a Hugging Face directory any more: "
                                "the checkpoint holds only the adapters")
    mesh = single_device_mesh()
    model = from_pretrained(base_path, mesh=mesh, dtype=dtype, param_dtype=dtype, task=info["task"])
    return lora.with_adapters(model, lora.LoraSpec(int(spec["rank"]), float(spec["alpha"]), tuple(spec["targets"])), mesh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export a saved training step as a Hugging Face directory.")
    parser.add_argument("--checkpoint", required=True, help="checkpoint root (.../checkpoints) or a step directory")
    parser.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    parser.add_argument("--step", type=int, default=None, help="step to export (default: the latest complete one)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.step)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
