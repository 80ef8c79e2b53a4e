"""PPO with a learned critic (GAE advantages) on the built-in tiny model and synthetic arithmetic.

    python -m rlhf_jax.main --config=configs/ppo.py

One sample per prompt; the critic starts from the policy checkpoint with a new
value head and shares the actor's batch sizes. Sizes divide evenly for 1, 2, 4
or 8 data-parallel devices.
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config


def get_config() -> ConfigDict:
    cfg = base_config()
    cfg.trainer.experiment_name = "ppo_tiny_arithmetic"

    cfg.data.train_files = ("builtin:arithmetic",)
    cfg.data.val_files = ("builtin:arithmetic",)
    cfg.data.max_prompt_length = 128
    cfg.data.max_response_length = 16
    cfg.data.train_batch_size = 32
    cfg.data.val_batch_size = 32

    arr = cfg.actor_rollout_ref
    arr.model.path = "builtin:tiny"
    arr.rollout.n = 1
    arr.rollout.log_prob_micro_batch_size_per_gpu = 4
    arr.ref.log_prob_micro_batch_size_per_gpu = 4
    arr.actor.ppo_mini_batch_size = 16  # 2 optimizer steps per training step
    arr.actor.ppo_micro_batch_size_per_gpu = 2
    arr.actor.ppo_epochs = 1
    arr.actor.optim.lr = 1e-4
    arr.actor.use_kl_loss = False

    cfg.critic.enable = True
    cfg.critic.optim.lr = 1e-4
    cfg.critic.cliprange_value = 0.5
    cfg.critic.forward_micro_batch_size_per_gpu = 4

    cfg.algorithm.adv_estimator = "gae"
    cfg.algorithm.gamma = 1.0
    cfg.algorithm.lam = 1.0
    cfg.algorithm.use_kl_in_reward = False

    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 20
    cfg.trainer.critic_warmup = 0
    cfg.trainer.test_freq = 10
    cfg.trainer.save_freq = 10
    return cfg
