"""Two stages in one run: SFT warm-up on the arithmetic answers, then GRPO from the SFT weights (Trinity's
``stages``), on the built-in tiny model.

    python -m rlhf_jax.main --config=configs/sft_grpo_stages.py

The shared config is the GRPO recipe's (configs/grpo.py); each stage overrides what differs from it. Stage
directories: ``<trainer.default_local_dir>/stage_0_sft_warmup`` and ``stage_1_grpo`` (checkpoints,
metrics.jsonl, the HF export the next stage starts from). Stopped (Ctrl-C, SIGTERM) in any stage, the same
command continues in that stage from its latest checkpoint.
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config
from rlhf_jax.config.recipes import tiny_arithmetic


def get_config() -> ConfigDict:
    cfg = tiny_arithmetic(base_config(), experiment="sft_grpo_tiny_arithmetic", steps=100)
    actor = cfg.actor_rollout_ref.actor
    actor.use_kl_loss = True
    actor.kl_loss_coef = 0.001
    cfg.algorithm.adv_estimator = "grpo"
    cfg.stages = (
        {"stage_name": "sft_warmup",
         "algorithm": {"type": "sft"},
         "data": {"train_files": ["builtin:arithmetic?max_value=2&train_size=1024"]},
         "actor_rollout_ref.actor.optim": {"lr": 5e-3, "warmup_style": "cosine"},
         "trainer": {"total_training_steps": 50, "test_freq": 25, "save_freq": 25}},
        {"stage_name": "grpo",
         "algorithm": {"type": "rl", "adv_estimator": "grpo"},
         "trainer": {"total_training_steps": 100}},
    )
    return cfg
