"""RLOO (leave-one-out baseline over the n samples of a prompt) with the KL penalty in the reward.

    python -m rlhf_jax.main --config=configs/rloo.py

Built-in tiny model and synthetic arithmetic; sizes divide evenly for 1, 2, 4 or 8 data-parallel devices.
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config


def get_config() -> ConfigDict:
    cfg = base_config()
    cfg.trainer.experiment_name = "rloo_tiny_arithmetic"

    cfg.data.train_files = ("builtin:arithmetic",)
    cfg.data.val_files = ("builtin:arithmetic",)
    cfg.data.max_prompt_length = 128
    cfg.data.max_response_length = 16
    cfg.data.train_batch_size = 16
    cfg.data.val_batch_size = 32

    arr = cfg.actor_rollout_ref
    arr.model.path = "builtin:tiny"
    arr.rollout.n = 8
    arr.rollout.log_prob_micro_batch_size_per_gpu = 16
    arr.ref.log_prob_micro_batch_size_per_gpu = 16
    arr.actor.ppo_mini_batch_size = 8
    arr.actor.ppo_micro_batch_size_per_gpu = 8
    arr.actor.optim.lr = 1e-4
    arr.actor.use_kl_loss = False

    cfg.algorithm.adv_estimator = "rloo"
    cfg.algorithm.use_kl_in_reward = True
    cfg.algorithm.kl_penalty = "kl"
    cfg.algorithm.kl_ctrl.type = "fixed"
    cfg.algorithm.kl_ctrl.kl_coef = 0.001

    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 20
    cfg.trainer.test_freq = 10
    cfg.trainer.save_freq = 10
    return cfg
