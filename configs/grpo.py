"""GRPO (group-normalised advantages, KL as a loss term) on the built-in tiny model and synthetic arithmetic.

Runs with no download on a 2-core CPU:

    python -m rlhf_jax.main --config=configs/grpo.py

Sizes divide evenly for 1, 2, 4 or 8 data-parallel devices. Point it at a real
model and data with overrides, e.g.
``--config.actor_rollout_ref.model.path=/path/to/hf_dir --config.data.train_files=/path/train.parquet``.
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config


def get_config() -> ConfigDict:
    cfg = base_config()
    cfg.trainer.experiment_name = "grpo_tiny_arithmetic"

    cfg.data.train_files = ("builtin:arithmetic",)
    cfg.data.val_files = ("builtin:arithmetic",)
    cfg.data.max_prompt_length = 128
    cfg.data.max_response_length = 16
    cfg.data.train_batch_size = 16
    cfg.data.val_batch_size = 32

    arr = cfg.actor_rollout_ref
    arr.model.path = "builtin:tiny"
    arr.rollout.n = 8
    arr.rollout.temperature = 1.0
    arr.rollout.log_prob_micro_batch_size_per_gpu = 16
    arr.ref.log_prob_micro_batch_size_per_gpu = 16

    arr.actor.ppo_mini_batch_size = 8  # prompts: 64 sequences, 2 optimizer steps per training step
    arr.actor.ppo_micro_batch_size_per_gpu = 8
    arr.actor.ppo_epochs = 1
    arr.actor.optim.lr = 1e-4  # a tiny random model needs far more than verl's 1e-6 for a 7B one
    arr.actor.use_kl_loss = True
    arr.actor.kl_loss_coef = 0.001
    arr.actor.kl_loss_type = "low_var_kl"
    arr.actor.entropy_coeff = 0.0
    arr.actor.loss_agg_mode = "token-mean"

    cfg.algorithm.adv_estimator = "grpo"
    cfg.algorithm.norm_adv_by_std_in_grpo = True
    cfg.algorithm.use_kl_in_reward = False

    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 20
    cfg.trainer.test_freq = 10
    cfg.trainer.save_freq = 10
    cfg.trainer.val_before_train = True
    return cfg
