"""DPO (sigmoid loss, beta 0.1) on the built-in tiny model and generated arithmetic preference pairs.

Runs with no download on a CPU in well under a minute:

    python -m rlhf_jax.main --config=configs/dpo.py

The data: prompts like ``3+1=`` (raw text), ``chosen`` the right value, ``rejected`` a value 1-3 off
(``builtin:arithmetic_preferences``). The policy starts equal to its frozen reference, so every implicit reward
is 0 and rewards/accuracies 0 (ties do not count); DPO lifts it towards 1 and val/rewards/accuracies on held-out
pairs with it.

Your own pairs: a jsonl/parquet/json/csv file with ``prompt``, ``chosen`` and ``rejected`` columns (strings or
chat messages), e.g. ``--config.data.train_files=/path/prefs.jsonl --config.data.val_files=/path/val.jsonl
--config.actor_rollout_ref.model.path=/path/to/hf_dir --config.data.prompt_template=native
--config.data.max_prompt_length=512 --config.data.max_response_length=512``.
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config


def get_config() -> ConfigDict:
    cfg = base_config()
    cfg.algorithm.type = "dpo"
    cfg.algorithm.dpo.beta = 0.1
    cfg.algorithm.dpo.label_smoothing = 0.0
    cfg.algorithm.dpo.loss_type = "sigmoid"
    cfg.trainer.experiment_name = "dpo_tiny_arithmetic"

    cfg.data.train_files = ("builtin:arithmetic_preferences?max_value=4&train_size=4096",)
    cfg.data.val_files = ("builtin:arithmetic_preferences?max_value=4&test_size=64",)
    cfg.data.prompt_template = "raw"
    cfg.data.max_prompt_length = 16
    cfg.data.max_response_length = 4
    cfg.data.train_batch_size = 32  # preference pairs per step
    cfg.data.val_batch_size = 64

    arr = cfg.actor_rollout_ref
    arr.model.path = "builtin:tiny"
    arr.model.use_remove_padding = False  # DPO runs padded batches
    arr.rollout.n = 1
    arr.actor.ppo_mini_batch_size = 32  # one optimizer step per batch of pairs
    arr.actor.ppo_micro_batch_size_per_gpu = -1  # the whole per-shard mini-batch at once
    arr.ref.log_prob_micro_batch_size_per_gpu = -1
    arr.actor.optim.lr = 1e-3  # a tiny random model needs far more than a 7B one

    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 60
    cfg.trainer.test_freq = 20
    cfg.trainer.save_freq = 60
    cfg.trainer.val_before_train = True
    return cfg
