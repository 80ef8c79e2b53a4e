"""verl's ``sft_trainer.yaml`` (``python -m verl.trainer.fsdp_sft_trainer``): sections data, model, optim, trainer.

Recognised by its top-level ``optim`` section (verl's PPO files keep optimizers under each role) or by
``model.partial_pretrain``. It becomes an SFT run (``algorithm.type=sft``) of ``model.partial_pretrain`` with the
actor's optimizer keys; verl's defaults apply where the file is silent. verl's SFT trainer validates and saves at
the last step whatever ``test_freq`` / ``save_freq`` say (<= 0 meaning only then), validates only the loss, and
not before the first step: so do these runs.
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.config.dialects.rules import Rule, get

MARKERS = ("optim", "ulysses_sequence_parallel_size")
_A = "actor_rollout_ref."
_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
           "float16": "float16"}


def is_sft_file(mapping: dict) -> bool:
    model = mapping.get("model")
    return bool(set(mapping) & set(MARKERS)) or isinstance(model, dict) and "partial_pretrain" in model


def _files(value: Any, _: dict) -> tuple:
    return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) else (str(value),)


def _freq(value: Any, _: dict) -> int | None:
    """verl's SFT trainer always validates / saves at the last step: <= 0 means only then (our None)."""
    return int(value) if value is not None and int(value) > 0 else None


def _dtype(value: Any, _: dict) -> str:
    if str(value) not in _DTYPES:
        raise ValueError(f"choose one of {', '.join(_DTYPES)}")
    return _DTYPES[str(value)]


def _scheduler(value: Any, _: dict) -> str:
    if value not in ("cosine", "wsd"):
        raise ValueError("verl's SFT trainer knows cosine and wsd")
    return str(value)


def _targets(value: Any, _: dict) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (str(value),)


_NONE = lambda v: v is None  # noqa: E731
_OFF = lambda v: not v  # noqa: E731
_IGNORED_OPTIM = "read by verl's newer engine trainer, not by its fsdp_sft_trainer"

RULES: tuple[Rule, ...] = (
    Rule("defaults", reason="Hydra's defaults list: the optim defaults it names are applied here"),
    Rule("data.train_batch_size", "data.train_batch_size", lambda v, _: int(v)),
    Rule("data.micro_batch_size", reason="deprecated in verl: micro_batch_size_per_gpu", accept=_NONE),
    Rule("data.micro_batch_size_per_gpu", "data.micro_batch_size_per_gpu", lambda v, _: int(v)),
    Rule("data.train_files", "data.train_files", _files),
    Rule("data.val_files", "data.val_files", _files),
    Rule("data.train_max_samples", "data.train_max_samples", lambda v, _: int(v)),
    Rule("data.val_max_samples", "data.val_max_samples", lambda v, _: int(v)),
    Rule("data.prompt_key", "data.prompt_key"),
    Rule("data.response_key", "data.response_key"),
    # verl indexes the column by each key in turn (row[prompt_key][k1][k2]...): a dotted path of data.prompt_key
    Rule("data.prompt_dict_keys", used_by="data.prompt_key"),
    Rule("data.response_dict_keys", used_by="data.response_key"),
    Rule("data.multiturn.enable", "data.multiturn.enable", lambda v, _: bool(v)),
    Rule("data.multiturn.messages_key", "data.multiturn.messages_key"),
    Rule("data.multiturn.tools_key", reason="tool definitions of a conversation are not rendered"),
    Rule("data.multiturn.enable_thinking_key", reason="a per-row thinking switch is not read "
         "(data.apply_chat_template_kwargs sets it for every row)"),
    Rule("data.max_length", "data.max_length", lambda v, _: int(v)),
    Rule("data.truncation", "data.truncation"),
    Rule("data.balance_dp_token", reason="not implemented", accept=_OFF),
    Rule("data.chat_template", "data.chat_template"),
    Rule("data.custom_cls.*", reason="custom dataset classes are not loaded", accept=_NONE),
    Rule("data.use_shm", reason="files are read from their path"),
    Rule("data.apply_chat_template_kwargs", "data.apply_chat_template_kwargs", lambda v, _: dict(v) or None),
    Rule("model.partial_pretrain", _A + "model.path"),
    Rule("model.use_shm", reason="files are read from their path"),
    Rule("model.fsdp_config.model_dtype", _A + "model.dtype", _dtype),
    Rule("model.fsdp_config.wrap_policy.*", reason="parameters are sharded by the mesh section"),
    # verl's trainer wraps with CPUOffload(offload_params=...) only under cpu_offload: the parameters (and with them
    # the optimizer state) in host memory
    Rule("model.fsdp_config.cpu_offload", convert=lambda v, f: {
        _A + f"actor.fsdp_config.{k}": bool(v and get(f, "model.fsdp_config.offload_params"))
        for k in ("param_offload", "optimizer_offload")}),
    Rule("model.fsdp_config.offload_params", used_by="model.fsdp_config.cpu_offload"),
    Rule("model.external_lib", reason="no external model code is imported", accept=_NONE),
    Rule("model.enable_gradient_checkpointing", _A + "model.enable_gradient_checkpointing", lambda v, _: bool(v)),
    Rule("model.trust_remote_code", reason="model families are built in; no remote code runs"),
    Rule("model.lora_rank", _A + "model.lora_rank", lambda v, _: int(v)),
    Rule("model.lora_alpha", _A + "model.lora_alpha", lambda v, _: float(v)),
    Rule("model.target_modules", _A + "model.target_modules", _targets),
    Rule("model.use_liger", reason="XLA fuses the loss; no Liger kernels"),
    Rule("model.strategy", reason="one JAX program sharded by the mesh section (no FSDP strategy)"),
    Rule("optim.lr", _A + "actor.optim.lr", lambda v, _: float(v)),
    Rule("optim.betas", _A + "actor.optim.betas", lambda v, _: tuple(float(b) for b in v)),
    Rule("optim.weight_decay", _A + "actor.optim.weight_decay", lambda v, _: float(v)),
    Rule("optim.lr_warmup_steps_ratio", _A + "actor.optim.lr_warmup_steps_ratio", lambda v, _: float(v)),
    Rule("optim.warmup_steps_ratio", _A + "actor.optim.lr_warmup_steps_ratio", lambda v, _: float(v)),
    Rule("optim.lr_warmup_steps", _A + "actor.optim.lr_warmup_steps", lambda v, _: int(v)),
    Rule("optim.clip_grad", _A + "actor.grad_clip", lambda v, _: float(v)),
    Rule("optim.lr_scheduler", _A + "actor.optim.warmup_style", _scheduler),
    Rule("optim.optimizer", _A + "actor.optim.optimizer"),
    Rule("optim.optimizer_impl", reason="optimizers come from optax", accept=lambda v: v in (None, "torch.optim")),
    Rule("optim.min_lr_ratio", _A + "actor.optim.min_lr_ratio", lambda v, _: float(v or 0.0)),
    Rule("optim.num_cycles", _A + "actor.optim.num_cycles", lambda v, _: float(v)),
    Rule("optim.total_training_steps", reason="trainer.total_training_steps decides", accept=lambda v: v in (None, -1)),
    Rule("optim.lr_scheduler_type", reason=_IGNORED_OPTIM + " (lr_scheduler is)"),
    Rule("optim.warmup_style", reason=_IGNORED_OPTIM + " (lr_scheduler is)"),
    # the optimizer class's further arguments, in PyTorch's names, as verl's build_optimizer passes them
    Rule("optim.override_optimizer_config", _A + "actor.optim.override_optimizer_config",
         lambda v, _: dict(v) if v else None),
    Rule("optim._target_", reason="verl's config class"),
    Rule("ulysses_sequence_parallel_size", "mesh.context", lambda v, _: int(v)),
    Rule("use_remove_padding", _A + "model.use_remove_padding", lambda v, _: bool(v)),
    Rule("trainer.default_local_dir", "trainer.default_local_dir"),
    Rule("trainer.default_hdfs_dir", reason="no HDFS copy", accept=_NONE),
    Rule("trainer.resume_path", "trainer.resume_from_path"),
    Rule("trainer.resume_mode", "trainer.resume_mode"),
    Rule("trainer.resume_from_path", "trainer.resume_from_path"),
    Rule("trainer.project_name", "trainer.project_name"),
    Rule("trainer.experiment_name", "trainer.experiment_name"),
    Rule("trainer.total_epochs", "trainer.total_epochs", lambda v, _: int(v)),
    Rule("trainer.total_training_steps", "trainer.total_training_steps", lambda v, _: None if v is None else int(v)),
    Rule("trainer.logger", "trainer.logger", lambda v, _: tuple(v) if isinstance(v, (list, tuple)) else (str(v),)),
    Rule("trainer.seed", "trainer.seed", lambda v, _: int(v)),
    Rule("trainer.save_freq", "trainer.save_freq", _freq),
    Rule("trainer.test_freq", "trainer.test_freq", _freq),
    Rule("trainer.max_ckpt_to_keep", "trainer.max_actor_ckpt_to_keep", lambda v, _: None if v is None else int(v)),
    Rule("trainer.checkpoint.save_contents", _A + "actor.checkpoint.save_contents", lambda v, _: tuple(v)),
    Rule("trainer.checkpoint.load_contents", _A + "actor.checkpoint.load_contents",
         lambda v, _: None if v is None else tuple(v)),
    Rule("trainer.nnodes", "trainer.nnodes", lambda v, _: None if v is None else int(v)),
    Rule("trainer.n_gpus_per_node", "trainer.n_gpus_per_node", lambda v, _: None if v is None else int(v)),
    Rule("trainer.device", reason="the JAX backend decides"),
)

# verl's sft_trainer.yaml (and its optim defaults) where the file is silent.
DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 256,
    "data.micro_batch_size_per_gpu": 4,
    "data.prompt_key": "question",
    "data.response_key": "answer",
    "data.max_length": 1024,
    "data.truncation": "error",
    "model.enable_gradient_checkpointing": True,
    "model.lora_alpha": 16,
    "optim.lr": 1e-5,
    "optim.betas": [0.9, 0.95],
    "optim.weight_decay": 0.01,
    "optim.lr_warmup_steps_ratio": 0.1,
    "optim.clip_grad": 1.0,
    "optim.lr_scheduler": "cosine",
    "trainer.total_epochs": 4,
    "trainer.seed": 1,
    "trainer.save_freq": -1,
    "trainer.test_freq": -1,
}


def finish(full: dict, values: dict[str, Any]) -> None:
    if _A + "model.path" not in values:
        raise ValueError("model.partial_pretrain is required: the checkpoint to fine-tune")
    values.update({"algorithm.type": "sft", "trainer.val_before_train": False, "trainer.val_accuracy": False})
    data = full.get("data") or {}
    for which in ("prompt", "response"):
        inner = data.get(f"{which}_dict_keys")
        if inner:
            column = values.get(f"data.{which}_key") or DEFAULTS[f"data.{which}_key"]
            values[f"data.{which}_key"] = ".".join([str(column), *map(str, inner)])
    if not full.get("data", {}).get("val_files"):
        values["data.val_files"] = ()
