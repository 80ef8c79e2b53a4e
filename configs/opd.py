"""On-policy distillation: the built-in tiny model learns arithmetic from a teacher's log-probs alone (verl's
``distillation`` section; Thinking Machines' on-policy distillation).

    python -m rlhf_jax.main --config=configs/sft.py   # the teacher: the SFT recipe (~20 s, greedy accuracy ~0.86)
    python -m rlhf_jax.main --config=configs/opd.py   # the student

The student (a fresh built-in tiny model) answers ``a+b=`` prompts; the teacher, the SFT recipe's exported
weights, scores each sampled token; the per-token reverse KL ``log pi_student - log pi_teacher`` (k1), negated, is
the token's advantage in PPO's clipped loss. No task reward trains the student (``use_task_rewards=False``), yet
its greedy accuracy on the held-out sums rises from 0 (about 0.3 after 200 steps). Another teacher:
``--config.distillation.teacher_models.teacher_model.model_path=DIR`` (the student's tokenizer).
"""

import os

from ml_collections import ConfigDict

from rlhf_jax.config import base_config
from rlhf_jax.config.recipes import tiny_arithmetic

# Where configs/sft.py exports its last step (its trainer.default_local_dir, then hf/global_step_<steps>).
SFT_EXPORT = os.path.join("checkpoints", "rlhf_jax", "sft_tiny_arithmetic", "hf", "global_step_100")


def get_config() -> ConfigDict:
    cfg = tiny_arithmetic(base_config(), experiment="opd_tiny_arithmetic", n=1, steps=400)
    cfg.algorithm.adv_estimator = "grpo"  # verl's script's; its advantages are not trained without task rewards
    dist = cfg.distillation
    dist.enabled = True
    dist.teacher_models.teacher_model.model_path = SFT_EXPORT
    loss = dist.distillation_loss
    loss.loss_mode = "k1"
    loss.use_policy_gradient = True
    loss.use_task_rewards = False
    return cfg
