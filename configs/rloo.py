"""RLOO (leave-one-out baseline over the n samples of a prompt) with the KL penalty in the reward.

    python -m rlhf_jax.main --config=configs/rloo.py

Built-in tiny model and synthetic arithmetic (see rlhf_jax/config/recipes.py).
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config
from rlhf_jax.config.recipes import tiny_arithmetic


def get_config() -> ConfigDict:
    cfg = tiny_arithmetic(base_config(), experiment="rloo_tiny_arithmetic")
    cfg.actor_rollout_ref.actor.use_kl_loss = False
    cfg.algorithm.adv_estimator = "rloo"
    cfg.algorithm.use_kl_in_reward = True
    cfg.algorithm.kl_penalty = "kl"
    cfg.algorithm.kl_ctrl.type = "fixed"
    cfg.algorithm.kl_ctrl.kl_coef = 0.001
    return cfg
