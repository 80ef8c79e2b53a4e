"""REINFORCE++ (discounted returns, whitened over the batch, no critic) with the KL penalty in the reward.

    python -m rlhf_jax.main --config=configs/reinforce_pp.py

Built-in tiny model and synthetic arithmetic (see rlhf_jax/config/recipes.py).
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config
from rlhf_jax.config.recipes import tiny_arithmetic


def get_config() -> ConfigDict:
    cfg = tiny_arithmetic(base_config(), experiment="reinforce_pp_tiny_arithmetic")
    cfg.actor_rollout_ref.actor.use_kl_loss = False
    cfg.algorithm.adv_estimator = "reinforce_plus_plus"
    cfg.algorithm.gamma = 1.0
    cfg.algorithm.use_kl_in_reward = True
    cfg.algorithm.kl_penalty = "kl"
    cfg.algorithm.kl_ctrl.kl_coef = 0.001
    return cfg
