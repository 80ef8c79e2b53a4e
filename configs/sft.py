"""Supervised fine-tuning of the built-in tiny model on synthetic arithmetic (verl's sft_trainer, in our keys).

    python -m rlhf_jax.main --config=configs/sft.py

Rows are the RL recipes' arithmetic prompts (``7+5=``, raw text, no chat template) with their ground truth
as the response (``12`` followed by EOS); the loss covers the response tokens only. Validation reports
``val/loss`` and the greedy answers' score by the arithmetic scorer (``val-core/arithmetic/reward/mean@1``),
which climbs from 0 to ~0.85 in the 100 steps (about a minute on a 2-core CPU).

For your own data: ``--config.data.train_files=qa.json --config.data.prompt_key=question
--config.data.response_key=answer`` (unset keys are recognised by name: Question/Answer files need none), or
chat conversations with ``--config.data.multiturn.enable=True`` (column data.multiturn.messages_key). A verl
``sft_trainer.yaml`` runs as is: ``--config=sft_trainer.yaml``.
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config


def get_config() -> ConfigDict:
    cfg = base_config()
    cfg.algorithm.type = "sft"
    cfg.trainer.experiment_name = "sft_tiny_arithmetic"
    cfg.data.train_files = ("builtin:arithmetic?max_value=9&train_size=4096",)
    cfg.data.val_files = ("builtin:arithmetic?max_value=9",)
    cfg.data.prompt_template = "raw"
    cfg.data.max_prompt_length = 16
    cfg.data.max_response_length = 4  # greedy validation answers: two digits and EOS
    cfg.data.max_length = 32
    cfg.data.train_batch_size = 32
    cfg.data.val_batch_size = 100
    cfg.data.micro_batch_size_per_gpu = -1

    arr = cfg.actor_rollout_ref
    arr.model.path = "builtin:tiny"
    arr.actor.optim.lr = 5e-3  # a tiny random model; verl's 1e-5 is for a 7B one
    arr.actor.optim.lr_warmup_steps_ratio = 0.05
    arr.actor.optim.warmup_style = "cosine"
    arr.actor.optim.betas = (0.9, 0.95)  # verl's sft_trainer
    arr.actor.grad_clip = 1.0

    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 100
    cfg.trainer.test_freq = 50
    cfg.trainer.save_freq = 50
    cfg.trainer.val_before_train = True
    cfg.trainer.log_val_generations = 2
    return cfg
