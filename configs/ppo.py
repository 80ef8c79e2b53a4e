"""PPO with a critic: GAE advantages, clipped policy and value losses, one sample per prompt.

    python -m rlhf_jax.main --config=configs/ppo.py

Built-in tiny model and synthetic arithmetic (see rlhf_jax/config/recipes.py); the critic starts
from the same checkpoint with a fresh value head.
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config
from rlhf_jax.config.recipes import tiny_arithmetic


def get_config() -> ConfigDict:
    # One sample per prompt, so more prompts per step; two optimizer steps per training step.
    cfg = tiny_arithmetic(base_config(), experiment="ppo_tiny_arithmetic", n=1, train_batch_size=128,
                          ppo_mini_batch_size=64)
    cfg.actor_rollout_ref.actor.use_kl_loss = False
    cfg.critic.enable = True
    cfg.critic.optim.lr = 1e-3
    cfg.critic.cliprange_value = 0.5
    cfg.algorithm.adv_estimator = "gae"
    cfg.algorithm.gamma = 1.0
    cfg.algorithm.lam = 1.0
    cfg.algorithm.use_kl_in_reward = False
    cfg.trainer.critic_warmup = 0
    return cfg
