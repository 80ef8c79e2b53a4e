"""ROLL's RLVR pipeline config (``rlvr_config.yaml``) onto the schema.

ROLL describes one run as global PPO settings plus worker sections (``actor_train``, ``actor_infer``,
``reference``, ``critic``, ``rewards``, ``validation``), each with ``model_args``, ``training_args``,
``generating_args``, ``data_args``, ``strategy_args`` and a ``device_mapping``. Here every role runs in one
JAX program on every device: strategies and device mappings have no meaning (one warning lists them),
and the sizes that matter are read from them (``per_device_train_batch_size`` x
``gradient_accumulation_steps`` x the training devices is ROLL's optimizer batch). Keys ROLL's defaults
give a meaning the schema's defaults do not (``loss_agg_mode``, ``lambd``, gradient checkpointing) get
ROLL's defaults when the file omits them.
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.config.dialects.roll_partial import lora_rules
from rlhf_jax.config.dialects.roll_shaping import RULES as shaping_rules
from rlhf_jax.config.dialects.rules import Rule, get
from rlhf_jax.config.dialects.rules import needs_critic as _needs_critic

MARKERS = ("actor_train", "actor_infer", "rollout_batch_size", "num_return_sequences_in_group", "pretrain")

_A = "actor_rollout_ref."
_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16"}
_STRATEGY = "DeepSpeed/Megatron/vLLM/SGLang settings: one JAX program, sharded by the mesh section"
_PLACEMENT = "every role runs colocated on all JAX devices (the mesh section shards them)"
_COUNTS = "ROLL's sizes follow from rollout_batch_size and num_return_sequences_in_group"


def _dtype(value: Any, _: dict) -> str:
    if str(value) not in _DTYPES:
        raise ValueError(f"model_args.dtype={value!r}: use fp32, bf16 or fp16")
    return _DTYPES[str(value)]


def _logger(value: Any, _: dict) -> tuple[str, ...]:
    sinks = {"tensorboard": ("console", "tensorboard"), "wandb": ("console", "wandb"), "stdout": ("console",)}
    if value not in sinks:
        raise ValueError(f"track_with={value!r}: rlhf_jax logs to tensorboard, wandb or stdout")
    return sinks[value]


def _resume(value: Any, _: dict) -> dict:
    if value is False or value is None:
        return {"trainer.resume_mode": "disable"}
    if value is True:
        return {"trainer.resume_mode": "auto"}
    return {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(value)}


def _response_length(value: Any, full: dict) -> dict:
    if get(full, "response_length") is not None:
        return {}  # response_length wins, as in ROLL
    return {"data.max_response_length": int(value) - int(get(full, "prompt_length", 1024))}


def _clip_range(value: Any, full: dict) -> dict:
    if not value:
        return {}
    return {_A + "actor.clip_ratio_low": float(get(full, "pg_clip_low", 0.2)),
            _A + "actor.clip_ratio_high": float(get(full, "pg_clip_high", 0.2))}


def _adaptive(value: Any, _: dict) -> dict:
    if value is None:
        return {}
    return {"algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.target_kl": float(value)}


def _template(value: Any, _: dict) -> str:
    # ROLL's named templates (qwen2_5, qwen3_nothink, ...) render the model's own chat format.
    return "native"


def _train_files(value: Any, _: dict) -> tuple[str, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (str(value),)


def _devices(full: dict, role: str) -> int:
    mapping = get(full, f"{role}.device_mapping")
    if isinstance(mapping, str):  # ROLL writes list(range(0,8)) or "[0, 1]"
        text = mapping.strip()
        if text.startswith("list(range(") and text.endswith("))"):
            lo, _, hi = text[len("list(range("):-2].partition(",")
            return max(int(hi) - int(lo), 1) if hi else max(int(lo), 1)
        return len([t for t in text.strip("[]").split(",") if t.strip()]) or 1
    return len(mapping) if isinstance(mapping, (list, tuple)) and mapping else 1


def _mini_batch(role: str, prefix: str):
    """ROLL's optimizer batch (per-device batch x accumulation x training devices, in sequences) in prompts."""
    def convert(value: Any, full: dict) -> dict:
        per_device = int(get(full, f"{role}.training_args.per_device_train_batch_size", 1))
        sequences = per_device * int(value) * _devices(full, role)
        n = int(get(full, "num_return_sequences_in_group", 1))
        if sequences % n:
            raise ValueError(f"{role}.training_args: per_device_train_batch_size x gradient_accumulation_steps x "
                             f"devices = {sequences} sequences is not a whole number of prompt groups of "
                             f"num_return_sequences_in_group={n}")
        return {prefix + "ppo_mini_batch_size": sequences // n}
    return convert


def _optim(role: str, prefix: str) -> tuple[Rule, ...]:
    t = f"{role}.training_args."
    o = prefix + "optim."
    return (
        Rule(t + "learning_rate", o + "lr", lambda v, _: float(v)),
        Rule(t + "weight_decay", o + "weight_decay", lambda v, _: float(v)),
        Rule(t + "warmup_steps", o + "lr_warmup_steps", lambda v, _: int(v)),
        Rule(t + "warmup_ratio", o + "lr_warmup_steps_ratio", lambda v, _: float(v)),
        Rule(t + "lr_scheduler_type", o + "warmup_style"),
        Rule(t + "adam_beta1", used_by=t + "adam_beta2"),
        Rule(t + "adam_beta2", o + "betas", lambda v, full: (float(get(full, t + "adam_beta1", 0.9)), float(v))),
        Rule(t + "adam_epsilon", o + "eps", lambda v, _: float(v)),
        Rule(t + "per_device_train_batch_size", prefix + "ppo_micro_batch_size_per_gpu", lambda v, _: int(v)),
        Rule(t + "gradient_accumulation_steps", convert=_mini_batch(role, prefix)),
        Rule(t + "num_train_epochs", reason="the run length is max_steps"),
        Rule(t + "max_steps", reason="the run length is max_steps"),
        Rule(t + "seed", reason="the seed is the top-level seed"),
        Rule(t + "*", reason="Hugging Face TrainingArguments with no effect here",
             accept=lambda v: v is None or v is False),
    )


def _domains(value: Any, full: dict) -> dict:
    """ROLL's per-domain batches: its rows' ``domain`` column, else the domain whose reward worker's tag_included
    lists the row's ``tag``, else math_rule (rlvr_pipeline.update_dataset_domain)."""
    if not value:
        return {}
    rewards = get(full, "rewards") or {}
    tags = {str(name): [str(t) for t in w.get("tag_included") or ()] for name, w in rewards.items()
            if isinstance(w, dict) and w.get("tag_included")}
    return {"data.domain_weights": {str(d): float(w) for d, w in value.items()}, "data.domain_key": "domain",
            "data.domain_tags": tags or None, "data.tag_key": "tag", "data.default_domain": "math_rule"}


# The critic's model types of ROLL's value-model provider: TRL's causal LM with a value head, or a token classifier
# with one label; both are a linear head on the checkpoint's trunk, as rlhf_jax's critic (TRL's head also applies
# dropout, 0.1, to its input in training; this one does not).
_CRITIC_TYPES = ("trl", "auto_token_classification")


def _worker_common(role: str) -> tuple[Rule, ...]:
    return (
        Rule(f"{role}.strategy_args", reason=_STRATEGY),
        Rule(f"{role}.device_mapping", reason=_PLACEMENT),
        Rule(f"{role}.num_gpus_per_worker", reason=_PLACEMENT),
        Rule(f"{role}.world_size", reason=_PLACEMENT),
        Rule(f"{role}.worker_cls", reason="ROLL's worker classes", accept=lambda v: v is None or "roll." in str(v)),
        Rule(f"{role}.model_args.attn_implementation", reason="attention: actor_rollout_ref.model.attn_implementation"),
        Rule(f"{role}.model_args.model_name_or_path", reason="the models come from pretrain / reward_pretrain"),
        Rule(f"{role}.model_args.model_type", reason="the model's architecture comes from its config.json",
             accept=lambda v: v is None or (role == "critic" and v in _CRITIC_TYPES)),
        Rule(f"{role}.model_args.ulysses_size", reason="sequence parallelism: the mesh section shards the model"),
        Rule(f"{role}.system_envs", used_by="finish (trainer.env_vars)"),
    )


_WORKERS = ("actor_train", "actor_infer", "reference", "critic", "validation")


def _output_dir(value: Any, full: dict) -> dict:
    # ROLL stages checkpoints in output_dir and keeps them in checkpoint_config.output_dir when that is given
    return {} if get(full, "checkpoint_config.output_dir") else {"trainer.default_local_dir": value}


# Keys every ROLL pipeline's config has (BaseConfig's): the file, the run, its output and logging.
RUN_RULES: tuple[Rule, ...] = (
    Rule("defaults", reason="Hydra defaults list: composed before the file is read (config/hydra_compose.py)"),
    Rule("hydra", reason="Hydra runtime settings"),
    Rule("exp_name", "trainer.experiment_name"),
    Rule("seed", "trainer.seed", lambda v, _: int(v)),
    Rule("output_dir", convert=_output_dir),
    Rule("logging_dir", "trainer.log_dir"),
    Rule("track_with", "trainer.logger", _logger),
    Rule("tracker_kwargs.project", "trainer.project_name"),
    Rule("tracker_kwargs.*", reason="tracker settings: wandb reads WANDB_* environment variables"),
    Rule("max_steps", "trainer.total_training_steps", lambda v, _: int(v)),
    Rule("save_steps", "trainer.save_freq", lambda v, _: int(v)),
    Rule("eval_steps", "trainer.test_freq", lambda v, _: int(v)),
    Rule("logging_steps", reason="every step is logged"),
    Rule("max_ckpt_to_keep", "trainer.max_actor_ckpt_to_keep", lambda v, _: int(v) if v else None),
    Rule("resume_from_checkpoint", convert=_resume),
    Rule("num_gpus_per_node", "trainer.n_gpus_per_node", lambda v, _: int(v)),
    Rule("num_nodes", "trainer.nnodes", lambda v, _: int(v)),
    Rule("rpc_timeout", reason="no Ray"),
    Rule("system_envs", used_by="finish (trainer.env_vars)"),
    Rule("checkpoint_config.type", reason="checkpoints are files under trainer.default_local_dir",
         accept=lambda v: v in (None, "file_system")),
    Rule("checkpoint_config.output_dir", "trainer.default_local_dir"),
    Rule("profiler_timeline", reason="profile with trainer.profile_steps (jax.profiler)", accept=lambda v: not v),
    Rule("profiler_memory", reason="profile with trainer.profile_steps (jax.profiler)", accept=lambda v: not v),
    Rule("async_generation_ratio", reason="sampling and training alternate in one program", accept=lambda v: not v),
    Rule("generate_opt_level", reason="the sampler is the built-in JAX decode loop"),
    Rule("max_running_requests", reason="the sampler decodes the whole batch"),
)

RULES: tuple[Rule, ...] = (
    *RUN_RULES,
    Rule("is_num_return_sequences_expand", reason="the sampler shares each prompt's KV cache among its samples"),
    # batch sizes and lengths
    Rule("rollout_batch_size", "data.train_batch_size", lambda v, _: int(v)),
    Rule("val_batch_size", "data.val_batch_size", lambda v, _: int(v)),
    Rule("num_return_sequences_in_group", _A + "rollout.n", lambda v, _: int(v)),
    Rule("prompt_length", "data.max_prompt_length", lambda v, _: int(v)),
    Rule("response_length", "data.max_response_length", lambda v, _: int(v)),
    Rule("sequence_length", convert=_response_length),
    Rule("val_prompt_length", reason="validation uses the training lengths",
         accept=lambda v: v is None),
    Rule("val_sequence_length", reason="validation uses the training lengths", accept=lambda v: v is None),
    # models
    Rule("pretrain", _A + "model.path"),
    Rule("reward_pretrain", "critic.model.path"),
    # PPO
    Rule("ppo_epochs", _A + "actor.ppo_epochs", lambda v, _: int(v)),
    Rule("max_grad_norm", convert=lambda v, _: {_A + "actor.grad_clip": float(v), "critic.grad_clip": float(v)}),
    Rule("l2", reason="L2 regularisation: set actor_rollout_ref.actor.optim.weight_decay", accept=lambda v: not v),
    Rule("lambd", "algorithm.lam", lambda v, _: float(v)),
    Rule("gamma", "algorithm.gamma", lambda v, _: float(v)),
    Rule("pg_clip", _A + "actor.clip_ratio", lambda v, _: float(v)),
    Rule("use_pg_clip_range", convert=_clip_range),
    Rule("pg_clip_low", used_by="use_pg_clip_range"),
    Rule("pg_clip_high", used_by="use_pg_clip_range"),
    Rule("value_clip", convert=lambda v, _: {} if v is None else {"critic.cliprange_value": float(v)}),
    Rule("kl_penalty", "algorithm.kl_penalty"),
    Rule("target_kl", convert=_adaptive),
    Rule("init_kl_coef", "algorithm.kl_ctrl.kl_coef", lambda v, _: float(v)),
    Rule("kl_horizon", "algorithm.kl_ctrl.horizon", lambda v, _: int(v)),
    Rule("add_token_level_kl", "algorithm.use_kl_in_reward", lambda v, _: bool(v)),
    Rule("use_kl_loss", _A + "actor.use_kl_loss", lambda v, _: bool(v)),
    Rule("kl_loss_coef", _A + "actor.kl_loss_coef", lambda v, _: float(v)),
    Rule("entropy_loss_coef", _A + "actor.entropy_coeff", lambda v, _: float(v)),
    Rule("loss_agg_mode", _A + "actor.loss_agg_mode"),
    Rule("critic_warmup", "trainer.critic_warmup", lambda v, _: int(v)),
    *shaping_rules,  # estimator, normalisation, clips, masks, dual clip (roll_shaping.py)
    Rule("enable_reference", reason="the reference is loaded when a KL term needs it"),
    Rule("enable_old_logprobs_recompute", reason="old log-probs are always recomputed by the actor"),
    # the sampler's log-probs as the old policy's: verl's bypass mode with PPO's clipped loss
    Rule("force_disable_old_logprobs_recompute", "algorithm.rollout_correction.bypass_mode", lambda v, _: bool(v)),
    Rule("use_policy_loss_type", reason="the policy loss is PPO's (actor_rollout_ref.actor.policy_loss)",
         accept=lambda v: v == "PPO"),
    Rule("importance_sampling", reason="token-level ratios (sequence-level: policy_loss.loss_mode=gspo)",
         accept=lambda v: v == "token"),
    Rule("rl_loss_coef", reason="the policy loss has weight 1", accept=lambda v: float(v) == 1.0),
    # actor_train
    Rule("actor_train.model_args.dtype", _A + "model.compute_dtype", _dtype),
    Rule("actor_train.model_args.disable_gradient_checkpointing", _A + "model.enable_gradient_checkpointing",
         lambda v, _: not v),
    *lora_rules("actor_train"),
    *lora_rules("actor_infer"),
    *_optim("actor_train", _A + "actor."),
    Rule("actor_train.data_args.file_name", "data.train_files", _train_files),
    Rule("actor_train.data_args.template", "data.prompt_template", _template),
    Rule("actor_train.data_args.prompt", "data.prompt_key"),
    Rule("actor_train.data_args.messages", "data.prompt_key"),
    Rule("actor_train.data_args.dataset_dir", reason="data files are read at the paths given"),
    Rule("actor_train.data_args.preprocessing_num_workers", reason="prompts are tokenized in-process"),
    Rule("actor_train.data_args.interleave_probs", reason="ROLL's DataArguments has no such field"),
    Rule("actor_train.data_args.domain_interleave_probs", convert=_domains),
    Rule("actor_train.infer_batch_size", _A + "rollout.log_prob_micro_batch_size_per_gpu", lambda v, _: int(v)),
    *_worker_common("actor_train"),
    # actor_infer
    Rule("actor_infer.generating_args.temperature", _A + "rollout.temperature", lambda v, _: float(v)),
    Rule("actor_infer.generating_args.top_p", _A + "rollout.top_p", lambda v, _: float(v)),
    Rule("actor_infer.generating_args.top_k", _A + "rollout.top_k", lambda v, _: int(v)),
    Rule("actor_infer.generating_args.max_new_tokens", reason="set from response_length (as ROLL rewrites it)"),
    Rule("actor_infer.generating_args.num_return_sequences", reason=_COUNTS),
    Rule("actor_infer.generating_args.num_beams", reason="sampling draws one sequence per sample",
         accept=lambda v: v in (None, 1)),
    Rule("actor_infer.generating_args.repetition_penalty", reason="no repetition penalty",
         accept=lambda v: v in (None, 1, 1.0)),
    Rule("actor_infer.model_args.dtype", reason="the sampler computes in actor_rollout_ref.model.compute_dtype"),
    Rule("actor_infer.model_args.disable_gradient_checkpointing", reason="sampling has no backward pass"),
    Rule("actor_infer.data_args", reason="prompts come from actor_train.data_args"),
    Rule("actor_infer.infer_batch_size", reason="the sampler decodes the whole batch"),
    *_worker_common("actor_infer"),
    # reference
    Rule("reference.infer_batch_size", _A + "ref.log_prob_micro_batch_size_per_gpu", lambda v, _: int(v)),
    Rule("reference.model_args.dtype", reason="the reference computes in actor_rollout_ref.model.compute_dtype"),
    Rule("reference.model_args.disable_gradient_checkpointing", reason="the reference has no backward pass"),
    Rule("reference.data_args", reason="prompts come from actor_train.data_args"),
    *_worker_common("reference"),
    # critic
    Rule("critic.model_args.disable_gradient_checkpointing", "critic.model.enable_gradient_checkpointing",
         lambda v, _: not v),
    Rule("critic.model_args.dtype", reason="the critic computes in actor_rollout_ref.model.compute_dtype"),
    *_optim("critic", "critic."),
    Rule("critic.infer_batch_size", "critic.forward_micro_batch_size_per_gpu", lambda v, _: int(v)),
    Rule("critic.data_args", reason="prompts come from actor_train.data_args"),
    *_worker_common("critic"),
    # rule-based rewards by domain tag: here each row's data_source picks the built-in scorer
    Rule("rewards.*.system_envs", used_by="finish (trainer.env_vars)"),
    Rule("rewards.*.system_envs.*", used_by="finish (trainer.env_vars)"),
    Rule("rewards.*.worker_cls", reason="rule-based workers: each row's data_source picks the built-in scorer; an "
         "LLM judge or a reward-model worker per domain (a generative judge) is not available",
         accept=lambda v: "llm_judge" not in str(v) and "reward_model" not in str(v)),
    Rule("rewards.*.tag_included", used_by="actor_train.data_args.domain_interleave_probs"),
    Rule("rewards.*.model_args", reason="rule-based scoring needs no model"),
    Rule("rewards.*", reason="rule-based scoring follows each row's data_source (rlhf_jax's scorers)"),
    # validation
    Rule("validation.data_args.file_name", "data.val_files", _train_files),
    Rule("validation.generating_args.temperature", _A + "rollout.val_kwargs.temperature", lambda v, _: float(v)),
    Rule("validation.generating_args.top_p", _A + "rollout.val_kwargs.top_p", lambda v, _: float(v)),
    Rule("validation.generating_args.top_k", _A + "rollout.val_kwargs.top_k", lambda v, _: int(v)),
    Rule("validation.generating_args.*", reason="validation lengths follow the training ones"),
    Rule("validation.data_args.*", reason="validation prompts are rendered like the training ones"),
    *_worker_common("validation"),
    Rule("validation.*", reason=_STRATEGY),
    Rule("val_greedy", convert=lambda v, _: {_A + "rollout.val_kwargs.do_sample": not v}),
    Rule("val_n_sample", _A + "rollout.val_kwargs.n", lambda v, _: int(v)),
)

# ROLL's defaults where they differ from the schema's (a ROLL file that omits the key means these).
DEFAULTS: dict[str, Any] = {
    "seed": 42,
    "max_steps": 500,
    "save_steps": 50,
    "eval_steps": 10,
    "rollout_batch_size": 128,
    "val_batch_size": 128,
    "prompt_length": 1024,
    "lambd": 0.95,
    "init_kl_coef": 0.2,
    "kl_loss_coef": 0.0,
    "loss_agg_mode": "seq-mean-token-mean",
    "dual_clip_loss": False,
    "adv_estimator": "gae",
    "whiten_advantages": False,
    "resume_from_checkpoint": False,
    "actor_train.model_args.disable_gradient_checkpointing": False,
    "critic.model_args.disable_gradient_checkpointing": False,
}


def _env_vars(full: dict) -> dict[str, str]:
    """ROLL's system_envs: the top level's for the driver and every worker, a worker's own winning for that worker.
    Here every worker is this one process, so each variable must have one value wherever the file names it."""
    sections = [("system_envs", get(full, "system_envs"))]
    sections += [(f"{role}.system_envs", get(full, f"{role}.system_envs")) for role in _WORKERS]
    rewards = get(full, "rewards")
    if isinstance(rewards, dict):
        sections += [(f"rewards.{name}.system_envs", get(full, f"rewards.{name}.system_envs")) for name in rewards]
    out: dict[str, str] = {}
    where: dict[str, str] = {}
    for path, envs in sections:
        if envs is None:
            continue
        if not isinstance(envs, dict):
            raise ValueError(f"{path}={envs!r}: a mapping of environment variables is expected")
        for name, value in envs.items():
            text = "" if value is None else str(value)
            if name in out and out[name] != text:
                raise ValueError(f"{path}.{name}={text!r} but {where[name]}.{name}={out[name]!r}: every worker runs "
                                 f"in one process here, so {name} can have only one value")
            out.setdefault(name, text)
            where.setdefault(name, path)
    return out


def finish(full: dict, values: dict[str, Any]) -> None:
    """Checks between keys once every rule has run."""
    env_vars = _env_vars(full)
    if env_vars:
        values["trainer.env_vars"] = env_vars
    if not get(full, "response_length") and not get(full, "sequence_length"):
        raise ValueError("ROLL needs response_length or sequence_length")
    if "critic.model.path" in values and not _needs_critic(values["algorithm.adv_estimator"]):
        values.pop("critic.model.path")  # ROLL loads the critic only for GAE


# The pieces ROLL's other pipelines' tables (roll_dpo.py) are built from.
devices, dtype, template, train_files, env_vars = _devices, _dtype, _template, _train_files, _env_vars
optim_rules, worker_rules = _optim, _worker_common

