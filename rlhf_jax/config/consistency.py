"""Rules between keys whose values are accepted only in the combinations rlhf_jax can honour.

Each rule stops the run before anything is compiled, naming the key and what to set instead; it never
changes a value (that is finalize's ``_fill_defaults``).
"""

from __future__ import annotations

import os

from ml_collections import ConfigDict

from rlhf_jax.config import schema
from rlhf_jax.config.keys_policy import OPTIMIZERS
from rlhf_jax.train.optim import optimizer_settings


def _same_path(a: str, b: str) -> bool:
    """Two model / tokenizer paths naming the same thing (a local directory in any spelling, or one Hub id)."""
    norm = lambda p: os.path.abspath(os.path.expanduser(p)) if os.path.exists(os.path.expanduser(p)) else p  # noqa: E731
    return norm(a) == norm(b)


# Keys read only by the SFT trainer (algorithm.type=sft): set under another type they would do nothing.
SFT_ONLY = ("data.response_key", "data.multiturn.enable", "data.multiturn.messages_key", "data.max_length",
            "data.micro_batch_size_per_gpu", "trainer.val_accuracy")


def _check_sft_only(cfg: ConfigDict) -> None:
    from rlhf_jax.config import schema

    if cfg.algorithm.type == "sft":
        return
    for path in SFT_ONLY:
        value = schema.get_path(cfg, path)
        if value != schema.get_key(path).default:
            raise ValueError(f"{path}={value!r} is read by SFT only (algorithm.type=sft), not by algorithm.type="
                             f"{cfg.algorithm.type}; unset it (in a run with stages, set it in the SFT stage)")


def check_consistency(cfg: ConfigDict) -> None:
    """Raise ValueError for the first combination of keys that cannot be honoured."""
    _check_sft_only(cfg)
    for path, optim in (("actor_rollout_ref.actor.optim", cfg.actor_rollout_ref.actor.optim),
                        ("critic.optim", cfg.critic.optim)):
        if str(optim.optimizer).lower() not in OPTIMIZERS:
            raise ValueError(f"{path}.optimizer={optim.optimizer!r}: choose one of AdamW, Adam, SGD, Lion, Adafactor")
        optimizer_settings(str(optim.optimizer), optim.override_optimizer_config,
                           f"{path}.override_optimizer_config")
        if str(optim.optimizer).lower() == "adafactor":  # its own moments: betas / eps would do nothing
            for name in ("betas", "eps"):
                default = schema.get_key(f"{path}.{name}").default
                value = tuple(optim[name]) if name == "betas" else optim[name]
                if value != default:
                    raise ValueError(f"{path}.{name}={optim[name]!r} has no meaning for Adafactor: leave it at "
                                     f"{default!r} and set {path}.override_optimizer_config (beta1, eps)")
    if "hf_model" in cfg.critic.checkpoint.save_contents:
        raise ValueError("critic.checkpoint.save_contents: hf_model is not supported (only the actor is exported "
                         "as a Hugging Face directory); remove it")
    steps = cfg.trainer.profile_steps or ()
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in steps):
        raise ValueError(f"trainer.profile_steps={tuple(steps)!r}: give step numbers >= 1 (as logged), e.g. (2, 3)")
    if cfg.reward_model.enable:  # the reward model's score is the reward; rule-based settings would do nothing
        rm = "reward_model.enable=True scores with the reward model alone (as verl does)"
        if cfg.custom_reward_function.path:
            raise ValueError(f"{rm}: custom_reward_function.path would not be called; unset one of them")
        if cfg.reward_model.overlong_buffer.enable:
            raise ValueError(f"{rm}: reward_model.overlong_buffer applies to rule-based scores; unset one of them")
        if cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "acc":
            raise ValueError(f"{rm}, which has no 'acc': set algorithm.filter_groups.metric=score")
    policy_tokenizer = cfg.data.tokenizer or cfg.actor_rollout_ref.model.path
    rm_input = cfg.reward_model.model.input_tokenizer
    if cfg.reward_model.enable and rm_input and not _same_path(rm_input, policy_tokenizer):
        raise ValueError(f"reward_model.model.input_tokenizer={rm_input!r}: responses are decoded with the policy's "
                         f"tokenizer ({policy_tokenizer!r}) and re-tokenized with the reward model's; leave it unset "
                         "or set it to the policy's (change data.tokenizer to decode with another)")
