"""ROLL's DPO pipeline config (``examples/dpo_examples/*.yaml``, run by ``start_dpo_pipeline.py``) onto the schema.

The file is ROLL's BaseConfig (run, output, logging: :data:`roll.RUN_RULES`) plus DPO's keys (``beta``, ``ipo``,
``label_smoothing``, ``chosen_key``, ``rejected_key``, ``global_template``) and two workers, ``actor_train`` and
``reference``. What ROLL's pipeline does with them, and what that is here:

- rows: the prompt is the ``instruction`` column as one user message, rendered with the model's chat template, the
  responses the ``chosen_key`` / ``rejected_key`` columns; a pair whose prompt + chosen or prompt + rejected is
  longer than ``sequence_length`` tokens is dropped (``data.max_length`` with ``data.filter_overlong_prompts``);
- a step is ``per_device_train_batch_size x gradient_accumulation_steps x`` the training devices pairs, one
  optimizer step; the run lasts ``num_train_epochs`` passes over the pairs or ``max_steps``, whichever ends first;
- the loss: ``-logsigmoid(beta x logits)`` with cDPO's ``label_smoothing``, or IPO's ``(logits - 1/(2 beta))^2``.
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.config.dialects import roll
from rlhf_jax.config.dialects.rules import Rule, get

_A = "actor_rollout_ref."
# keys only ROLL's DPO pipeline has: a file naming one is a DPO run
MARKERS = ("ipo", "beta", "label_smoothing", "chosen_key", "rejected_key")


def is_dpo(mapping: dict) -> bool:
    return any(key in mapping for key in MARKERS)


def _batch(value: Any, full: dict) -> dict:
    pairs = int(get(full, "actor_train.training_args.per_device_train_batch_size", 1)) * int(value) \
        * roll.devices(full, "actor_train")
    return {"data.train_batch_size": pairs, _A + "actor.ppo_mini_batch_size": pairs}


def _length(value: Any, _: dict) -> dict:
    n = int(value)
    return {"data.max_length": n, "data.max_prompt_length": n, "data.max_response_length": n,
            "data.filter_overlong_prompts": True}


_T = "actor_train.training_args."
RULES: tuple[Rule, ...] = (
    *roll.RUN_RULES,
    Rule("sequence_length", convert=_length),
    Rule("pretrain", _A + "model.path"),
    Rule("max_grad_norm", _A + "actor.grad_clip", lambda v, _: float(v)),
    Rule("ipo", "algorithm.dpo.loss_type", lambda v, _: "ipo" if v else "sigmoid"),
    Rule("beta", "algorithm.dpo.beta", lambda v, _: float(v)),
    Rule("label_smoothing", "algorithm.dpo.label_smoothing", lambda v, _: float(v)),
    Rule("chosen_key", "data.chosen_key"),
    Rule("rejected_key", "data.rejected_key"),
    Rule("global_template", "data.prompt_template", roll.template),
    Rule("actor_train.model_args.dtype", _A + "model.compute_dtype", roll.dtype),
    Rule("actor_train.model_args.disable_gradient_checkpointing", _A + "model.enable_gradient_checkpointing",
         lambda v, _: not v),
    Rule(_T + "gradient_accumulation_steps", convert=_batch),
    Rule(_T + "num_train_epochs", "trainer.total_epochs", lambda v, _: int(v)),
    *(r for r in roll.optim_rules("actor_train", _A + "actor.")
      if r.their not in (_T + "gradient_accumulation_steps", _T + "num_train_epochs")),
    Rule("actor_train.data_args.file_name", "data.train_files", roll.train_files),
    Rule("actor_train.data_args.template", "data.prompt_template", roll.template),
    Rule("actor_train.data_args.dataset_dir", reason="data files are read at the paths given"),
    Rule("actor_train.data_args.preprocessing_num_workers", reason="pairs are tokenized in-process"),
    Rule("actor_train.infer_batch_size", _A + "ref.log_prob_micro_batch_size_per_gpu", lambda v, _: int(v)),
    *roll.worker_rules("actor_train"),
    Rule("reference.infer_batch_size", reason="the reference's log-probs are computed with the actor's micro-batch"),
    Rule("reference.model_args.dtype", reason="the reference computes in actor_rollout_ref.model.compute_dtype"),
    Rule("reference.model_args.disable_gradient_checkpointing", reason="the reference has no backward pass"),
    Rule("reference.data_args", reason="pairs come from actor_train.data_args"),
    *roll.worker_rules("reference"),
    Rule("validation.data_args.file_name", "data.val_files", roll.train_files),
    Rule("validation.data_args.*", reason="validation pairs are read like the training ones"),
)

# ROLL's defaults where they differ from the schema's (DPOConfig and BaseConfig); the pairs are padded rows
# (use_remove_padding off), and ROLL's prompt column is fixed.
DEFAULTS: dict[str, Any] = {
    "seed": 42,
    "max_steps": 500,
    "save_steps": 50,
    "eval_steps": 10,
    "resume_from_checkpoint": False,
    "actor_train.model_args.disable_gradient_checkpointing": False,
    "actor_train.training_args.gradient_accumulation_steps": 1,
    "actor_train.training_args.num_train_epochs": 1,
}


def finish(full: dict, values: dict[str, Any]) -> None:
    values["algorithm.type"] = "dpo"
    values["data.prompt_key"] = "instruction"
    values[_A + "model.use_remove_padding"] = False
    env_vars = roll.env_vars(full)
    if env_vars:
        values["trainer.env_vars"] = env_vars
    if not get(full, "sequence_length"):
        raise ValueError("ROLL's DPO pipeline needs sequence_length")
