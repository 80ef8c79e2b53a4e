"""DAPO: GRPO advantages with clip-higher, token-mean aggregation, no KL, the overlong penalty, dynamic sampling.

    python -m rlhf_jax.main --config=configs/dapo.py

Built-in tiny model and synthetic arithmetic (see rlhf_jax/config/recipes.py), with 8-token
responses so the overlong buffer (the last 4 tokens) has room to act. Dynamic sampling
(``algorithm.filter_groups``) drops prompt groups whose responses all score the same and samples more
prompts until the batch is full; the built-in scorers report no ``acc``, so the score must vary.
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config
from rlhf_jax.config.recipes import tiny_arithmetic


def get_config() -> ConfigDict:
    cfg = tiny_arithmetic(base_config(), experiment="dapo_tiny_arithmetic", response_length=8)
    actor = cfg.actor_rollout_ref.actor
    actor.optim.weight_decay = 0.1
    actor.clip_ratio_low = 0.2
    actor.clip_ratio_high = 0.28  # clip-higher
    actor.clip_ratio_c = 10.0
    actor.loss_agg_mode = "token-mean"
    actor.use_kl_loss = False
    actor.kl_loss_coef = 0.0
    actor.entropy_coeff = 0.0
    cfg.algorithm.adv_estimator = "grpo"
    cfg.algorithm.use_kl_in_reward = False
    cfg.algorithm.kl_ctrl.kl_coef = 0.0
    ob = cfg.reward_model.overlong_buffer
    ob.enable = True
    ob.len = 4  # the last 4 of 8 response tokens ramp the penalty up to penalty_factor
    ob.penalty_factor = 1.0
    cfg.reward_model.reward_manager = "dapo"
    fg = cfg.algorithm.filter_groups
    fg.enable = True
    fg.metric = "score"
    fg.max_num_gen_batches = 10
    return cfg
