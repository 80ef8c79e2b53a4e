"""Every closed list of names a config key may take, once.

The key table (``keys_*.py``) uses these as ``choices``; the modules that act on a name (the attention
dispatcher, the optimizer builder, the reward managers, the loggers, the data generators, the trainers)
import their list from here, so a name cannot be accepted by the config and unknown to the code, or the
other way round. Open lists that users extend with a decorator (advantage estimators, policy losses, KL
estimators, tool-call parsers, tools) live in their registries instead.
"""

from __future__ import annotations

DTYPES = ("float32", "bfloat16", "float16")  # model.dtype, model.compute_dtype, rollout.dtype
# verl's other spellings of them (its PrecisionType), read as ours in its files and command lines
DTYPE_SPELLINGS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
REMAT_POLICIES = ("full", "dots_saveable")
ATTN_IMPLEMENTATIONS = ("auto", "dense", "blockwise", "cudnn", "splash")
CONTEXT_ATTENTION = ("auto", "ulysses", "gather")  # mesh.context_attention: attention under a sequence split
WARMUP_STYLES = ("constant", "cosine", "linear", "wsd")
CKPT_CONTENTS = ("model", "optimizer", "extra", "hf_model")

# optim.optimizer, compared lower-case (verl writes AdamW): key -> the class's own spelling
OPTIMIZER_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "lion": "Lion", "adafactor": "Adafactor"}

# algorithm.type: the trainers (their classes are registered by these names in the trainer registry)
TRAINER_TYPES = ("rl", "dpo", "sft")

REWARD_MANAGERS = ("naive", "prime", "batch", "dapo", "gdpo")
ANSWER_MATCH_MODES = ("any", "exact", "numeric", "last_number")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
PROMPT_TRUNCATION = ("error", "left", "right", "middle")  # data.truncation
TOOL_RESPONSE_TRUNCATION = ("left", "right", "middle")
FILTER_GROUP_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
RESUME_MODES = ("auto", "disable", "resume_path")

# builtin:<name> models and synthetic data sets (built or generated on first use, never downloaded)
BUILTIN_MODELS = ("tiny", "smollm2")
BUILTIN_DATASETS = ("arithmetic", "countdown", "word_problems", "arithmetic_preferences", "guess_number",
                    "calculator_demos", "env_tasks")


def check_type(name: str, key: str = "algorithm.type") -> None:
    """Raise ValueError naming ``key`` when ``name`` is no trainer."""
    if name not in TRAINER_TYPES:
        raise ValueError(f"{key}={name!r} is not valid: choose one of {', '.join(sorted(TRAINER_TYPES))}")

# Set on a command restarted with its trainer.env_vars (runtime/process_env.py); its config is read a second time.
ENV_RESTART_MARK = "RLHF_JAX_ENV_VARS_RESTARTED"
