"""Where a schema default differs from the value verl's generated ``ppo_trainer.yaml`` gives the same key,
and why. Everything not listed here has verl's default (tests/config/test_verl_defaults.py compares the two,
so a new difference must be listed and a stale entry removed); docs/CONFIG.md prints this table.
"""

from __future__ import annotations

from typing import Any

_EXAMPLE = "an example value of verl's file, not a default anyone keeps"
_SMALL = "sized for the built-in tiny model on one host; verl's is sized for a 7B model on 8 GPUs"
_PER_SHARD = "verl leaves it unset and requires it when training; here a small working value"

# schema key -> (verl's value, why ours differs)
DIFFERENCES: dict[str, tuple[Any, str]] = {
    "data.train_files": (("~/data/rlhf/gsm8k/train.parquet",), _EXAMPLE + "; builtin:arithmetic runs offline"),
    "data.val_files": (("~/data/rlhf/gsm8k/test.parquet",), _EXAMPLE + "; builtin:arithmetic runs offline"),
    "data.prompt_key": ("prompt", "None tries prompt first, then other common column names"),
    "data.seed": (None, "verl's loader reads null as seed 1, ours"),
    "data.max_prompt_length": (512, _SMALL),
    "data.max_response_length": (512, _SMALL),
    "data.train_batch_size": (1024, _SMALL),
    "actor_rollout_ref.model.path": ("~/models/deepseek-llm-7b-chat", _EXAMPLE + "; builtin:tiny runs offline"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (
        True, "remat trades compute for memory, which the small default models do not need; the memory plan says "
        "when to turn it on"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (256, _SMALL),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (None, _PER_SHARD),
    "actor_rollout_ref.actor.clip_ratio_low": (0.2, "None = clip_ratio, which is verl's 0.2"),
    "actor_rollout_ref.actor.clip_ratio_high": (0.2, "None = clip_ratio, which is verl's 0.2"),
    "actor_rollout_ref.actor.optim.warmup_style": (None, "verl's null defers to lr_scheduler_type, whose default "
                                                         "is constant, as ours"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (None, _PER_SHARD),
    "actor_rollout_ref.rollout.max_num_seqs": (256, "None = as many decode slots as the batch has rows (no vLLM "
                                                    "scheduler to bound)"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (None, _PER_SHARD),
    "actor_rollout_ref.rollout.dtype": ("bfloat16", "None = model.compute_dtype: float32 like the default actor, so "
                                                "the sampler's log-probs match the trainer's"),
    "critic.model.path": ("~/models/deepseek-llm-7b-chat", "None = actor_rollout_ref.model.path (verl's file "
                                                           "refers to it too)"),
    "critic.model.enable_gradient_checkpointing": (True, "as the actor's: off for the small default models"),
    "critic.model.use_remove_padding": (False, "None = the actor's (packing is exact and saves the padding FLOPs)"),
    "critic.ppo_max_token_len_per_gpu": (32768, "None = 2 x the actor's budget, which is how verl's value arises"),
    "critic.optim.warmup_style": (None, "verl's null defers to lr_scheduler_type, whose default is constant, as ours"),
    "reward_model.model.path": ("~/models/FsfairX-LLaMA3-RM-v0.1", _EXAMPLE),
    "reward_model.micro_batch_size_per_gpu": (None, _PER_SHARD),
    "reward_model.num_workers": (1, "here the worker processes of reward_manager=prime, which gain from two"),
    "trainer.total_epochs": (30, "one pass: the default run is a quick check"),
    "trainer.project_name": ("verl_examples", "names the run directory"),
    "trainer.experiment_name": ("gsm8k", "names the run directory"),
    "trainer.logger": (("console", "wandb"), "wandb is an optional package; tensorboard and jsonl need nothing"),
    "trainer.nnodes": (1, "None = the processes that were started"),
    "trainer.n_gpus_per_node": (8, "None = every device found, so the default runs on any machine"),
    "trainer.save_freq": (-1, "None = at the last step only, so a finished run can be exported and resumed"),
    "trainer.test_freq": (-1, "None = at the last step only"),
}
