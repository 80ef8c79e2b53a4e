"""Shared settings of the built-in recipes: the tiny model on synthetic arithmetic, sized for a CPU.

Each ``configs/*.py`` recipe calls :func:`tiny_arithmetic` and then sets only what
its algorithm needs, so the recipes differ exactly where the algorithms do.
"""

from __future__ import annotations

from ml_collections import ConfigDict


def tiny_arithmetic(
    cfg: ConfigDict,
    *,
    experiment: str,
    n: int = 16,
    train_batch_size: int = 16,
    ppo_mini_batch_size: int | None = None,
    response_length: int = 1,
    lr: float = 5e-4,
    steps: int = 400,
) -> ConfigDict:
    """Prompts ``a+b=`` (a, b in 0..2, raw text), ``response_length``-token answers, the built-in tiny
    model, whole-batch forward passes (micro-batch -1: fastest on a CPU), validation every 50 steps.

    With one-token answers a random policy scores ~0.007 and GRPO-style recipes reach > 0.8 within
    the default 400 steps (about a minute on a 2-core CPU).
    """
    cfg.trainer.experiment_name = experiment
    cfg.data.train_files = ("builtin:arithmetic?max_value=2&train_size=8192",)
    cfg.data.val_files = ("builtin:arithmetic?max_value=2",)
    cfg.data.prompt_template = "raw"
    cfg.data.max_prompt_length = 16
    cfg.data.max_response_length = response_length
    cfg.data.train_batch_size = train_batch_size
    cfg.data.val_batch_size = 100

    arr = cfg.actor_rollout_ref
    arr.model.path = "builtin:tiny"
    arr.rollout.n = n
    arr.rollout.log_prob_micro_batch_size_per_gpu = -1
    arr.ref.log_prob_micro_batch_size_per_gpu = -1
    arr.actor.ppo_mini_batch_size = ppo_mini_batch_size or train_batch_size
    arr.actor.ppo_micro_batch_size_per_gpu = -1
    arr.actor.ppo_epochs = 1
    arr.actor.optim.lr = lr  # a tiny random model needs far more than verl's 1e-6 for a 7B one

    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = steps
    cfg.trainer.test_freq = 50
    cfg.trainer.save_freq = 100
    cfg.trainer.val_before_train = True
    cfg.trainer.log_val_generations = 2
    return cfg
