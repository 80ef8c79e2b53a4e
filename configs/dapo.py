"""DAPO: GRPO advantages with clip-higher (0.2 / 0.28), token-mean loss, no KL, and the overlong penalty.

    python -m rlhf_jax.main --config=configs/dapo.py

Built-in tiny model and synthetic arithmetic; sizes divide evenly for 1, 2, 4 or 8 data-parallel devices.
DAPO's dynamic sampling (dropping groups whose samples all score the same) is not part of this recipe.
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config


def get_config() -> ConfigDict:
    cfg = base_config()
    cfg.trainer.experiment_name = "dapo_tiny_arithmetic"

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
    arr.rollout.top_p = 1.0
    arr.rollout.log_prob_micro_batch_size_per_gpu = 16
    arr.ref.log_prob_micro_batch_size_per_gpu = 16
    arr.actor.ppo_mini_batch_size = 8
    arr.actor.ppo_micro_batch_size_per_gpu = 8
    arr.actor.optim.lr = 1e-4
    arr.actor.optim.weight_decay = 0.1
    arr.actor.clip_ratio_low = 0.2
    arr.actor.clip_ratio_high = 0.28  # clip-higher
    arr.actor.clip_ratio_c = 10.0
    arr.actor.loss_agg_mode = "token-mean"
    arr.actor.use_kl_loss = False
    arr.actor.kl_loss_coef = 0.0
    arr.actor.entropy_coeff = 0.0

    cfg.algorithm.adv_estimator = "grpo"
    cfg.algorithm.use_kl_in_reward = False
    cfg.algorithm.kl_ctrl.kl_coef = 0.0

    ob = cfg.reward_model.overlong_buffer
    ob.enable = True
    ob.len = 4  # the last 4 of 16 response tokens ramp the penalty up to penalty_factor
    ob.penalty_factor = 1.0

    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 20
    cfg.trainer.test_freq = 10
    cfg.trainer.save_freq = 10
    return cfg
