"""The ``Trainer_config.yaml`` of the TRL-based RLHF trainer (PPO with a reward model on a Q/A JSON).

Its run is TRL's classic PPO: one response per question, scored by ``reward_config.reward_model_name``, a
per-token KL penalty to the reference in the reward (adaptive, from ``init_kl_coef``), GAE with whitened
advantages and PPO clipping without a dual clip. Its data file is a JSON with ``train`` / ``test`` lists of
``Question`` / ``Answer`` rows. TRL's PPOConfig defaults apply where the file is silent. ``freeze_config`` names
the policy's parts that do not train (``actor_rollout_ref.actor.freeze.*``, the same flags). The value model is
TRL's: a value head on the policy's trunk (``critic.shared_trunk``), trained by the policy's optimizer with the
value loss weighed by ``vf_coef`` (``critic.vf_coef``).
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.config.dialects.rules import Rule, get

MARKERS = ("data_config", "ppo_config", "generation_config", "freeze_config", "save_config", "reward_config")

_A = "actor_rollout_ref."


def _data_file(value: Any, _: dict) -> dict:
    """The Q/A JSON: its train and test lists, Question / Answer columns."""
    return {"data.train_files": (str(value),), "data.val_files": (str(value),), "data.train_split": "train",
            "data.val_split": "test", "data.prompt_key": "Question", "data.ground_truth_key": "Answer"}


def _mini_batch(value: Any, full: dict) -> dict:
    """TRL's optimizer batch: mini_batch_size x gradient_accumulation_steps responses (one per question)."""
    size = int(value) * int(get(full, "ppo_config.gradient_accumulation_steps", 1))
    batch = int(get(full, "ppo_config.batch_size"))
    if batch % size:
        raise ValueError(f"ppo_config.batch_size={batch} is not a multiple of mini_batch_size x "
                         f"gradient_accumulation_steps = {size}")
    return {_A + "actor.ppo_mini_batch_size": size}


def _reward_model(value: Any, _: dict) -> dict:
    return {"reward_model.enable": True, "reward_model.model.path": str(value)}


def _kl(value: Any, full: dict) -> dict:
    """TRL's KL penalty in the reward: init_kl_coef, adaptive (adap_kl_ctrl) towards target over horizon."""
    adaptive = bool(get(full, "ppo_config.adap_kl_ctrl", True))
    out = {"algorithm.use_kl_in_reward": float(value) > 0, "algorithm.kl_ctrl.kl_coef": float(value),
           "algorithm.kl_ctrl.type": "adaptive" if adaptive else "fixed"}
    if adaptive:
        out.update({"algorithm.kl_ctrl.target_kl": float(get(full, "ppo_config.target", 6.0)),
                    "algorithm.kl_ctrl.horizon": int(get(full, "ppo_config.horizon", 10000))})
    return out


_FREEZE = _A + "actor.freeze."


def _layers(value: Any, _: dict) -> tuple[int, ...]:
    """Decoder layer indices (ints, or digit strings) trained whatever the freeze flags say."""
    layers = [] if value is None else value if isinstance(value, (list, tuple)) else [value]
    out = []
    for layer in layers:
        if isinstance(layer, bool) or not str(layer).lstrip("-").isdigit():
            raise ValueError(f"{layer!r} is not a decoder layer index; list layer numbers (0, 1, ...)")
        out.append(int(layer))
    return tuple(out)


def _logger(value: Any, _: dict) -> tuple[str, ...]:
    if value not in ("wandb", "tensorboard", None):
        raise ValueError("use wandb or tensorboard")
    return ("console",) if value is None else ("console", value)


_OFF = lambda v: not v  # noqa: E731

RULES: tuple[Rule, ...] = (
    Rule("data_config.data_file_path", convert=_data_file),
    Rule("data_config.max_length_promt", "data.max_prompt_length", lambda v, _: int(v)),
    Rule("data_config.truncate_promt", "data.truncation", lambda v, _: "left" if v else "error"),
    Rule("data_config.padding", reason="prompts are left-padded to length buckets"),
    *(Rule(f"freeze_config.{name}", _FREEZE + name, lambda v, _: bool(v))
      for name in ("freeze_emb", "freeze_ln", "freeze_attn", "freeze_ff", "freeze_other")),
    Rule("freeze_config.layers_not_to_freeze", _FREEZE + "layers_not_to_freeze", _layers),
    Rule("generation_config.do_sample", _A + "rollout.do_sample", lambda v, _: bool(v)),
    Rule("generation_config.max_new_tokens", "data.max_response_length", lambda v, _: int(v)),
    Rule("generation_config.min_length", reason="a minimum length counting the prompt",
         accept=lambda v: v is None or int(v) <= 0),
    Rule("generation_config.top_k", _A + "rollout.top_k", lambda v, _: int(v) if int(v) > 0 else -1),
    Rule("generation_config.top_p", _A + "rollout.top_p", lambda v, _: float(v)),
    Rule("generation_config.temperature", _A + "rollout.temperature", lambda v, _: float(v)),
    Rule("global_epoches", "trainer.total_epochs", lambda v, _: int(v)),
    Rule("hf_hub_name", _A + "model.path"),
    Rule("ppo_config.model_name", _A + "model.path"),
    Rule("ppo_config.batch_size", "data.train_batch_size", lambda v, _: int(v)),
    Rule("ppo_config.forward_batch_size", _A + "rollout.log_prob_micro_batch_size_per_gpu",
         lambda v, _: int(v) if v else 2),
    Rule("ppo_config.mini_batch_size", convert=_mini_batch),
    Rule("ppo_config.gradient_accumulation_steps", used_by="ppo_config.mini_batch_size"),
    Rule("ppo_config.learning_rate", _A + "actor.optim.lr", lambda v, _: float(v)),
    Rule("ppo_config.max_grad_norm", _A + "actor.grad_clip", lambda v, _: float(v or 0.0)),
    Rule("ppo_config.ppo_epochs", _A + "actor.ppo_epochs", lambda v, _: int(v)),
    Rule("ppo_config.seed", "trainer.seed", lambda v, _: int(v)),
    Rule("ppo_config.steps", "trainer.total_training_steps", lambda v, _: int(v)),
    Rule("ppo_config.log_with", "trainer.logger", _logger),
    Rule("ppo_config.tracker_project_name", "trainer.project_name"),
    Rule("ppo_config.tracker_kwargs", reason="tracker settings: wandb reads WANDB_* environment variables"),
    Rule("ppo_config.accelerator_kwargs", reason="no Accelerate: one JAX program"),
    Rule("ppo_config.optimize_cuda_cache", reason="XLA manages device memory"),
    Rule("ppo_config.optimize_device_cache", reason="XLA manages device memory"),
    Rule("ppo_config.remove_unused_columns", reason="unused columns are never read"),
    Rule("ppo_config.init_kl_coef", convert=_kl),
    Rule("ppo_config.adap_kl_ctrl", used_by="ppo_config.init_kl_coef"),
    Rule("ppo_config.target", used_by="ppo_config.init_kl_coef"),
    Rule("ppo_config.horizon", used_by="ppo_config.init_kl_coef"),
    Rule("ppo_config.kl_penalty", "algorithm.kl_penalty"),
    Rule("ppo_config.gamma", "algorithm.gamma", lambda v, _: float(v)),
    Rule("ppo_config.lam", "algorithm.lam", lambda v, _: float(v)),
    Rule("ppo_config.cliprange", _A + "actor.clip_ratio", lambda v, _: float(v)),
    Rule("ppo_config.cliprange_value", "critic.cliprange_value", lambda v, _: float(v)),
    Rule("ppo_config.vf_coef", "critic.vf_coef", lambda v, _: float(v)),
    Rule("ppo_config.ratio_threshold", reason="mini-batches with large ratios are clipped, not skipped"),
    *(Rule("ppo_config." + name, reason="not implemented", accept=_OFF)
      for name in ("early_stopping", "use_score_scaling", "use_score_norm", "score_clip", "whiten_rewards")),
    Rule("reward_config.reward_model_name", convert=_reward_model),
    Rule("reward_config.batch_size", "reward_model.micro_batch_size_per_gpu", lambda v, _: int(v)),
    Rule("save_config.checkpoint_dir", "trainer.default_local_dir"),
    Rule("save_config.save_interval", "trainer.save_freq", lambda v, _: int(v)),
)

# TRL's PPOConfig defaults (and its fixed choices) where the file is silent.
DEFAULTS: dict[str, Any] = {
    "ppo_config.batch_size": 256,
    "ppo_config.mini_batch_size": 1,
    "ppo_config.learning_rate": 1.41e-5,
    "ppo_config.init_kl_coef": 0.2,
    "ppo_config.adap_kl_ctrl": True,
    "ppo_config.target": 6.0,
    "ppo_config.horizon": 10000,
    "ppo_config.lam": 0.95,
    "ppo_config.cliprange_value": 0.2,
    "ppo_config.vf_coef": 0.1,
    "ppo_config.ppo_epochs": 4,
    "ppo_config.max_grad_norm": None,
}


def finish(full: dict, values: dict[str, Any]) -> None:
    """TRL's fixed choices: GAE, one response per question, no dual clip, the value head on the policy's trunk."""
    values.update({"algorithm.adv_estimator": "gae", _A + "rollout.n": 1, _A + "actor.clip_ratio_c": 1e30,
                   _A + "actor.loss_agg_mode": "token-mean", "critic.shared_trunk": True})
    if "reward_model.enable" not in values:
        raise ValueError("reward_config.reward_model_name is required: this trainer scores with a reward model")
