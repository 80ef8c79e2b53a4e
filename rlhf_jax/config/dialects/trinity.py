"""Trinity-RFT's config onto the schema.

Trinity-RFT splits a run into an explorer (sampling workflows over a taskset), a buffer of experiences and a
trainer, synchronised every ``sync_interval`` steps. Here sampling and training alternate in one JAX program
(``mode: both``; ``sync_interval`` / ``sync_offset`` become the experience schedule: ``experience.buffer_size``,
``experience.overlap``): the explorer's engine and runner settings have no
meaning (one warning lists them), the taskset is the training data, the algorithm's functions map onto the
estimator, KL and loss keys, a workflow type other than Trinity's single-turn ones names one of ours
(``rollout.multi_turn.workflow``, with ``workflow_args``), and settings that would make the run something else
(other synchronisation offsets and styles, replay buffers, stages) are refused by name.
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.config.dialects import trinity_maps as M
from rlhf_jax.config.dialects import trinity_train as T
from rlhf_jax.config import schema
from rlhf_jax.config.dialects.rules import Rule, get, translate
from rlhf_jax.config.dialects.rules import needs_critic as _needs_critic

MARKERS = ("buffer", "explorer", "synchronizer", "mode", "checkpoint_root_dir")

_A = "actor_rollout_ref."
_ENGINE = "explorer engine and runner settings: the sampler is the built-in JAX decode loop"
_KL = {"k1": "kl", "kl": "kl", "k2": "mse", "mse": "mse", "k3": "low_var_kl", "low_var_kl": "low_var_kl",
       "abs": "abs"}
_ESTIMATORS = {"ppo": "gae", "gae": "gae", "grpo": "grpo", "rloo": "rloo", "reinforceplusplus": "reinforce_plus_plus",
               "reinforce_plus_plus": "reinforce_plus_plus", "remax": "remax", "opo": "opo"}
# Trinity's reward functions by the data_source whose built-in scorer does the same job here.
_REWARDS = {"math_reward": "math", "math_boxed_reward": "math", "countdown_reward": "countdown",
            "accuracy_reward": "answer_match"}
_TASKSET = "buffer.explorer_input.taskset."


def _estimator(value: Any, full: dict) -> dict:
    """algorithm_type, or advantage_fn where given, as the advantage estimator."""
    algorithm = get(full, "algorithm.algorithm_type")
    if algorithm in T.TRAIN_ALGORITHMS:
        return {}  # the trainer is chosen by mode (train)
    if algorithm not in ("ppo", "grpo"):
        raise ValueError(f"algorithm.algorithm_type={algorithm!r}: rlhf_jax trains ppo, grpo, sft and dpo runs (opmd "
                         "and mix are not implemented)")
    name = get(full, "algorithm.advantage_fn") or ("ppo" if algorithm == "ppo" else "grpo")
    if name not in _ESTIMATORS:
        raise ValueError(f"algorithm.advantage_fn={name!r}: use one of {', '.join(sorted(_ESTIMATORS))}")
    return {"algorithm.adv_estimator": _ESTIMATORS[name]}


def _kl(kind: str):
    """A KL function name (none, k1, k2, k3, abs, low_var_kl) as the switch and estimator of that KL term."""
    def convert(value: Any, full: dict) -> dict:
        algorithm = T.algorithm(full)
        if value == "default":  # not in the file: the algorithm's own (Trinity's default_config)
            value = "none" if kind == "kl_penalty" or algorithm == "sft" else "k2"
        if algorithm == "dpo" and kind == "kl_loss" and value in (None, "none"):
            value = "k2"  # Trinity's DPO always has a KL loss: it turns none into k2
        on = value not in (None, "none")
        if on and value not in _KL:
            raise ValueError(f"use none or one of {', '.join(sorted(_KL))}")
        args = get(full, f"algorithm.{kind}_fn_args") or {}
        if on and algorithm in T.TRAIN_ALGORITHMS and (kind == "kl_penalty" or algorithm == "sft"):
            raise ValueError(f"algorithm_type {algorithm} has no {kind.replace('_', ' ')}: use none")
        if algorithm in T.TRAIN_ALGORITHMS:
            if not on:
                return {}
            return {"algorithm.dpo.kl_loss_type": _KL[value],
                    "algorithm.dpo.kl_loss_coef": float(args.get("kl_coef", 0.001))}
        if kind == "kl_loss":
            out = {_A + "actor.use_kl_loss": on}
            if on:
                out[_A + "actor.kl_loss_type"] = _KL[value]
                out[_A + "actor.kl_loss_coef"] = float(args.get("kl_coef", 0.001))  # Trinity's KLFn default
        else:
            out = {"algorithm.use_kl_in_reward": on}
            if on:
                out["algorithm.kl_penalty"] = _KL[value]
            if "kl_coef" in args:
                out["algorithm.kl_ctrl.kl_coef"] = float(args["kl_coef"])
        return out
    return convert


def _policy_loss(value: Any, full: dict) -> dict:
    """policy_loss_fn (ppo) and its clip ranges and aggregation; dpo and sft for those algorithms."""
    if T.algorithm(full) == "dpo":
        return T.dpo_loss(value, full)
    if T.algorithm(full) == "sft":
        return T.sft_loss(value, full)
    value = "ppo" if value == "default" else value
    if value not in ("ppo", "gspo"):
        raise ValueError("use ppo or gspo")
    args = get(full, "algorithm.policy_loss_fn_args") or {}
    out = {_A + "actor.policy_loss.loss_mode": "vanilla" if value == "ppo" else "gspo"}
    keys = {"clip_range": "clip_ratio", "clip_range_low": "clip_ratio_low", "clip_range_high": "clip_ratio_high",
            "loss_agg_mode": "loss_agg_mode"}
    for name, arg in args.items():
        if name not in keys:
            raise ValueError(f"policy_loss_fn_args.{name} has no rlhf_jax equivalent")
        out[_A + "actor." + keys[name]] = arg if name == "loss_agg_mode" else float(arg)
    return out


def _entropy(value: Any, full: dict) -> dict:
    """entropy_loss_fn with its entropy_coef."""
    if value not in ("default", "none", None):
        raise ValueError("use default or none")
    coef = (get(full, "algorithm.entropy_loss_fn_args") or {}).get("entropy_coef", 0.0)
    if T.algorithm(full) in T.TRAIN_ALGORITHMS:
        if value != "none" and float(coef):
            raise ValueError(f"algorithm_type {T.algorithm(full)} has no entropy bonus here: set entropy_coef 0")
        return {}
    return {_A + "actor.entropy_coeff": 0.0 if value == "none" else float(coef)}


def _run_dir(value: Any, full: dict) -> str:
    """checkpoint_root_dir/project/name, where Trinity writes a run."""
    return f"{value}/{get(full, 'project', 'Trinity-RFT')}/{get(full, 'name', 'rft')}"


def _train_batch(value: Any, full: dict) -> dict:
    """train_batch_size (experiences per step) must be batch_size x repeat_times: one optimizer step per step."""
    if T.training_only(full):
        return T.train_batch(value, full)
    tasks, repeat = int(get(full, "buffer.batch_size")), int(get(full, "algorithm.repeat_times", 1))
    if value is not None and int(value) != tasks * repeat:
        raise ValueError(f"{value} experiences per step differs from buffer.batch_size x algorithm.repeat_times = "
                         f"{tasks * repeat}; set actor_rollout_ref.actor.ppo_mini_batch_size for smaller "
                         "optimizer batches")
    return {}


def _eval(value: Any, full: dict) -> dict:
    """The eval tasksets' files, split, temperature and repeat_times as validation settings."""
    sets = value if isinstance(value, list) else [value]
    files, splits, out = [], set(), {}
    for ts in sets:
        if ts.get("storage_type", "file") != "file":
            raise ValueError("only file tasksets are read")
        files.append(T.dataset(ts["path"], ts.get("subset_name"), "buffer.explorer_input.eval_tasksets"))
        splits.add(ts.get("split", "test"))
        args = ts.get("rollout_args") or {}
        if "temperature" in args:
            out[_A + "rollout.val_kwargs.temperature"] = float(args["temperature"])
        out[_A + "rollout.val_kwargs.n"] = int(ts.get("repeat_times", 1))
        key = (ts.get("format") or {}).get("prompt_key")
        if key and key != get(full, _TASKSET + "format.prompt_key", key):
            raise ValueError("eval tasksets must use the taskset's prompt_key")
    if len(splits) > 1:
        raise ValueError(f"eval tasksets read one split here, not {sorted(splits)}")
    out.update({"data.val_files": tuple(files), "data.val_split": splits.pop()})
    return out


def _reward(value: Any, _: dict) -> str:
    if value not in _REWARDS:
        raise ValueError(f"reward function {value!r}: rlhf_jax scores by data_source with the built-in scorers "
                         f"({', '.join(sorted(_REWARDS))} map onto them); use custom_reward_function.path otherwise")
    return _REWARDS[value]


_SINGLE_TURN_WORKFLOWS = (None, "math_workflow", "simple_workflow")
_MT = _A + "rollout.multi_turn."


def _workflow(value: Any, _: dict) -> dict:
    """Trinity's single-turn workflows are our single-turn rollout; any other name is a workflow of ours
    (registered name or path.py:function; finalize refuses an unknown one by name) run on the OpenAI-style client."""
    if value in _SINGLE_TURN_WORKFLOWS:
        return {}
    return {_MT + "enable": True, _MT + "workflow": str(value)}


def _default_workflow(value: Any, file: dict) -> dict:
    """The explorer's default workflow type, unless the taskset names its own; read as the taskset-level key."""
    return {} if get(file, _TASKSET + "default_workflow_type") is not None else _workflow(value, file)


def _workflow_args(value: Any, _: dict) -> dict:
    """rollout.multi_turn.workflow_args: every task of the workflow gets them as task['workflow_args']."""
    return {_MT + "workflow_args": dict(value)} if value else {}


def _eval_workflow(value: Any, file: dict) -> dict:
    """Validation runs the training workflow: another type is refused."""
    train = get(file, _TASKSET + "default_workflow_type") or get(file, "buffer.explorer_input.default_workflow_type")
    if value in _SINGLE_TURN_WORKFLOWS and train in _SINGLE_TURN_WORKFLOWS or value == train:
        return {}
    raise ValueError(f"validation runs the training workflow ({train!r}), not {value!r}")


def _sync(value: Any, file: dict) -> dict:
    """sync_interval K with sync_offset 0: K batches sampled with one set of weights, then trained on in order
    (experience.buffer_size=K); interval 1 with offset 1: sampling runs one step ahead of training
    (experience.overlap, on mesh.rollout_devices). Other pairs are refused."""
    if T.training_only(file):
        return {}  # no explorer to synchronise with
    interval, offset = int(value), int(get(file, "synchronizer.sync_offset", 0) or 0)
    if interval < 1 or offset < 0:
        raise ValueError("sync_interval must be >= 1 and sync_offset >= 0")
    if offset == 0:
        return {"experience.buffer_size": interval}
    if (interval, offset) == (1, 1):
        return {"experience.overlap": True}
    raise ValueError(f"with synchronizer.sync_offset={offset}: supported are sync_interval K with sync_offset 0 "
                     "(experience.buffer_size=K) and sync_interval 1 with sync_offset 1 (experience.overlap)")


def _off(value: Any) -> bool:
    """Switched off: falsy, a mapping whose enable(d) is falsy, or a mapping of settings that are all off."""
    if isinstance(value, dict):
        for switch in ("enable", "enabled"):
            if switch in value:
                return not value[switch]
        return all(_off(v) for v in value.values())
    return not value


def _tasks(value: Any, full: dict) -> dict:
    """Tasks per step; in mode train, rows per step where train_batch_size is not given."""
    if T.training_only(full) and get(full, "buffer.train_batch_size") is not None:
        return {}
    return {"data.train_batch_size": int(value)}


def _model_len(value: Any, full: dict) -> dict:
    """max_model_len: without max_prompt_tokens, the prompt may take what the response leaves (Trinity's rule)."""
    response = get(full, "model.max_response_tokens")
    if value is None or get(full, "model.max_prompt_tokens") is not None or response is None:
        return {}
    if int(value) <= int(response):
        raise ValueError(f"leaves no room for a prompt beside max_response_tokens={response}")
    return {"data.max_prompt_length": int(value) - int(response)}


def _verl_settings(value: Any, _: dict) -> dict:
    """verl keys inside the file (trainer_config): verl's names are rlhf_jax's, so they apply as written."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif prefix:
            out[prefix] = tuple(node) if isinstance(node, list) else node
    walk(value or {}, "")
    return out


def _logger(value: Any, _: dict) -> tuple[str, ...]:
    if value not in ("wandb", "tensorboard", "mlflow"):
        raise ValueError("use wandb, tensorboard or mlflow")
    return ("console", value)


RULES: tuple[Rule, ...] = (
    # global
    Rule("project", "trainer.project_name"),
    Rule("name", "trainer.experiment_name"),
    Rule("mode", convert=T.mode),
    Rule("checkpoint_root_dir", "trainer.default_local_dir", _run_dir),
    Rule("continue_from_checkpoint", "trainer.resume_mode", lambda v, _: "auto" if v else "disable"),
    Rule("ignore_validator_suggestions", reason="no validator suggestions"),
    # algorithm
    Rule("algorithm.algorithm_type", convert=_estimator),
    Rule("algorithm.advantage_fn", used_by="algorithm.algorithm_type"),
    Rule("algorithm.advantage_fn_args", convert=M.advantage_args),
    Rule("algorithm.repeat_times", convert=lambda v, f: {} if T.training_only(f) else {_A + "rollout.n": int(v)}),
    Rule("algorithm.optimizer.lr", _A + "actor.optim.lr", lambda v, _: float(v)),
    Rule("algorithm.optimizer.lr_scheduler_type", _A + "actor.optim.warmup_style"),
    Rule("algorithm.optimizer.warmup_style", _A + "actor.optim.warmup_style"),
    Rule("algorithm.optimizer.lr_warmup_steps", _A + "actor.optim.lr_warmup_steps", lambda v, _: int(v)),
    Rule("algorithm.optimizer.lr_warmup_steps_ratio", _A + "actor.optim.lr_warmup_steps_ratio", lambda v, _: float(v)),
    Rule("algorithm.optimizer.min_lr_ratio", _A + "actor.optim.min_lr_ratio", lambda v, _: float(v or 0.0)),
    Rule("algorithm.optimizer.weight_decay", _A + "actor.optim.weight_decay", lambda v, _: float(v)),
    Rule("algorithm.optimizer.betas", _A + "actor.optim.betas", lambda v, _: tuple(float(b) for b in v)),
    Rule("algorithm.sample_strategy", reason="experiences are used once, as sampled", accept=lambda v: v == "default"),
    Rule("algorithm.policy_loss_fn", convert=_policy_loss),
    Rule("algorithm.policy_loss_fn_args", used_by="algorithm.policy_loss_fn"),
    Rule("algorithm.kl_penalty_fn", convert=_kl("kl_penalty")),
    Rule("algorithm.kl_penalty_fn_args", used_by="algorithm.kl_penalty_fn"),
    Rule("algorithm.kl_loss_fn", convert=_kl("kl_loss")),
    Rule("algorithm.kl_loss_fn_args", used_by="algorithm.kl_loss_fn"),
    Rule("algorithm.entropy_loss_fn", convert=_entropy),
    Rule("algorithm.entropy_loss_fn_args", used_by="algorithm.entropy_loss_fn"),
    # model
    Rule("model.model_path", _A + "model.path"),
    Rule("model.critic_model_path", "critic.model.path"),
    Rule("model.max_prompt_tokens", "data.max_prompt_length", lambda v, _: int(v)),
    Rule("model.max_response_tokens", "data.max_response_length", lambda v, _: int(v)),
    Rule("model.min_response_tokens", _A + "rollout.min_new_tokens", lambda v, _: max(int(v) - 1, 0)),
    Rule("model.max_model_len", convert=_model_len),
    Rule("model.enable_prompt_truncation", "data.truncation", lambda v, _: "left" if v else "error"),
    Rule("model.repetition_penalty", reason="no repetition penalty", accept=lambda v: v in (None, 1, 1.0)),
    Rule("model.custom_chat_template", convert=lambda v, _: {} if v in (None, "None") else {"data.chat_template": v}),
    Rule("model.chat_template_path", convert=lambda v, _: {} if v in (None, "None") else {"data.chat_template": v}),
    Rule("model.lora_configs", convert=M.lora),
    Rule("model.rope_scaling", reason="RoPE comes from the checkpoint's config.json", accept=lambda v: v is None),
    Rule("model.rope_theta", reason="RoPE comes from the checkpoint's config.json", accept=lambda v: v is None),
    Rule("model.tinker", reason="Tinker backend", accept=_off),
    Rule("model.external_model", reason="external model APIs", accept=_off),
    # cluster, monitor, log
    Rule("cluster.node_num", "trainer.nnodes", lambda v, _: int(v)),
    Rule("cluster.gpu_per_node", "trainer.n_gpus_per_node", lambda v, _: int(v)),
    Rule("cluster.*", reason="Ray cluster settings: one JAX program per host"),
    Rule("monitor.monitor_type", "trainer.logger", _logger),
    Rule("monitor.monitor_args", reason="tracker settings: wandb / mlflow read their environment variables"),
    Rule("monitor.enable_ray_timeline", reason="no Ray", accept=lambda v: not v),
    Rule("log", reason="logging of Trinity's processes"),
    # buffer
    Rule("buffer.batch_size", convert=_tasks),
    Rule("buffer.max_retry_times", reason="SQL storage retries: data is read from files"),
    Rule("buffer.max_retry_interval", reason="SQL storage retries: data is read from files"),
    Rule("buffer.train_batch_size", convert=_train_batch),
    Rule("buffer.total_epochs", "trainer.total_epochs", lambda v, _: int(v)),
    Rule("buffer.total_steps", convert=lambda v, _: {} if v is None else {"trainer.total_training_steps": int(v)}),
    Rule("buffer.explorer_input.default_workflow_type", convert=_default_workflow),
    Rule("buffer.explorer_input.default_eval_workflow_type", convert=_eval_workflow),
    Rule("buffer.explorer_input.default_reward_fn_type", "data.default_data_source", lambda v, _: _reward(v, _)),
    Rule(_TASKSET + "path", "data.train_files",
         lambda v, f: (T.dataset(v, get(f, _TASKSET + "subset_name"), _TASKSET[:-1]),)),
    Rule(_TASKSET + "split", "data.train_split"),
    Rule(_TASKSET + "format.prompt_key", "data.prompt_key"),
    Rule(_TASKSET + "format.response_key", "data.ground_truth_key"),
    Rule(_TASKSET + "format.system_prompt", "data.system_prompt"),
    Rule(_TASKSET + "format.prompt_type", reason="string prompts and message lists are both read"),
    Rule(_TASKSET + "rollout_args.temperature", _A + "rollout.temperature", lambda v, _: float(v)),
    Rule(_TASKSET + "rollout_args.top_p", _A + "rollout.top_p", lambda v, _: float(v)),
    Rule(_TASKSET + "rollout_args.top_k", _A + "rollout.top_k", lambda v, _: int(v)),
    Rule(_TASKSET + "rollout_args.logprobs", reason="each sampled token's log-prob is kept (no alternatives)"),
    Rule(_TASKSET + "rollout_args.n", reason="samples per task come from algorithm.repeat_times",
         accept=lambda v: v in (None, 1)),
    Rule(_TASKSET + "rollout_args.*", reason="sampling settings: actor_rollout_ref.rollout", accept=lambda v: v is None),
    Rule(_TASKSET + "default_workflow_type", convert=_workflow),
    Rule(_TASKSET + "default_reward_fn_type", "data.default_data_source", lambda v, _: _reward(v, _)),
    Rule(_TASKSET + "repeat_times", _A + "rollout.n", lambda v, _: int(v)),
    Rule(_TASKSET + "storage_type", reason="tasksets are files", accept=lambda v: v == "file"),
    Rule(_TASKSET + "name", reason="the taskset's name (a Ray actor's)"),
    Rule(_TASKSET + "subset_name", used_by=_TASKSET + "path"),
    Rule(_TASKSET + "workflow_args", convert=_workflow_args),
    Rule("buffer.explorer_input.eval_tasksets", convert=_eval),
    Rule(T.EXPERIENCE, convert=T.experience_buffer),
    Rule("buffer.trainer_input.auxiliary_buffers", reason="auxiliary (SFT) buffers are not implemented",
         accept=lambda v: not v),
    # explorer
    Rule("explorer.eval_interval", "trainer.test_freq", lambda v, _: int(v)),
    Rule("explorer.eval_on_startup", "trainer.val_before_train", lambda v, _: bool(v)),
    Rule("explorer.over_rollout", reason="over-sampling with early stop is not implemented", accept=_off),
    Rule("explorer.dynamic_timeout", reason="no runners to time out", accept=_off),
    Rule("explorer.auxiliary_models", reason="auxiliary models are not implemented", accept=lambda v: not v),
    Rule("explorer.env_vars", "trainer.env_vars", lambda v, _: {str(k): str(x) for k, x in v.items()} if v else None),
    Rule("explorer.*", reason=_ENGINE),
    Rule("explorer.rollout_model", reason=_ENGINE),
    # synchronizer: how stale the explorer's weights may be = the experience schedule
    Rule("synchronizer.sync_interval", convert=_sync),
    Rule("synchronizer.sync_offset", used_by="synchronizer.sync_interval"),
    Rule("synchronizer.sync_style", reason="weights are synchronised on a fixed schedule",
         accept=lambda v: v in (None, "fixed")),
    Rule("synchronizer.*", reason="the sampler reads the actor's parameters directly"),
    # trainer
    Rule("trainer.total_steps", convert=lambda v, _: {} if v is None else {"trainer.total_training_steps": int(v)}),
    Rule("trainer.save_interval", "trainer.save_freq", lambda v, _: int(v)),
    Rule("trainer.save_hf_checkpoint", "trainer.save_hf_checkpoint"),
    Rule("trainer.grad_clip", _A + "actor.grad_clip", lambda v, _: float(v)),
    Rule("trainer.use_dynamic_bsz", _A + "actor.use_dynamic_bsz", lambda v, _: bool(v)),
    Rule("trainer.max_token_len_per_gpu", _A + "actor.ppo_max_token_len_per_gpu", lambda v, _: int(v)),
    Rule("trainer.ppo_max_token_len_per_gpu", _A + "actor.ppo_max_token_len_per_gpu", lambda v, _: int(v)),
    Rule("trainer.max_checkpoints_to_keep", "trainer.max_actor_ckpt_to_keep", lambda v, _: int(v) if v else None),
    Rule("trainer.ulysses_sequence_parallel_size", "mesh.context", lambda v, _: int(v or 1)),
    Rule("trainer.trainer_config", convert=_verl_settings),
    Rule("trainer.trainer_type", reason="the trainer is rlhf_jax's", accept=lambda v: v in (None, "verl")),
    Rule("trainer.*", reason="Trinity trainer process settings"),
    # the rest of Trinity's processes
    Rule("service", reason="Data-Juicer service", accept=lambda v: not v),
    Rule("data_processor", reason="data processing pipelines are not implemented", accept=lambda v: not v),
    Rule("stages", used_by="finish (stages)"),
)

# Trinity's choices where a file is silent (its defaults for these keys differ from the schema's).
DEFAULTS: dict[str, Any] = {
    "mode": "both",
    "algorithm.algorithm_type": "ppo",
    "algorithm.repeat_times": 1,
    "algorithm.policy_loss_fn": "default",  # the algorithm's own (ppo, sft or dpo)
    "algorithm.kl_loss_fn": "default",  # k2 (none for sft)
    "synchronizer.sync_interval": 1,
    "synchronizer.sync_offset": 0,
}


def finish(full: dict, values: dict[str, Any]) -> None:
    """Checks between keys once every rule has run; Trinity's stages as ours."""
    if full.get("stages"):
        values["stages"] = M.stages(full, values, lambda f, where: translate(f, RULES, DEFAULTS, "trinity", where, finish)[0],
                                    lambda key: schema.get_key(key).default)
    if not _needs_critic(values.get("algorithm.adv_estimator")):
        values.pop("critic.model.path", None)  # the critic exists only for an estimator that reads values
