"""ROLL's RLVR reward and advantage options (roll/pipeline/rlvr, roll/utils/functionals.py) onto algorithm.*.

ROLL turns scores into advantages in one order for every estimator: masks of whole responses (max_len_mask,
difficulty_mask), score normalisation (norm_mean_type / norm_std_type; grpo forces both to group), reward_clip,
token rewards with the optional token-level KL, reward_clip again, the estimator (gae, or reinforce: the discounted
return), whiten_advantages, advantage_clip. The schema's keys run in the same order (docs/algorithms.md).
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.config.dialects.rules import Rule, get

_G = "algorithm."
_NORMS = ("batch", "group", None)


def _norms(value: str, full: dict) -> tuple[Any, Any]:
    if value == "grpo":  # ROLL's reward_postprocess overrides both for grpo
        return "group", "group"
    mean, std = get(full, "norm_mean_type"), get(full, "norm_std_type")
    for name, kind in (("norm_mean_type", mean), ("norm_std_type", std)):
        if kind not in _NORMS:
            raise ValueError(f"{name}={kind!r}: rlhf_jax normalises by batch or group statistics (or null); "
                             "running statistics across steps are not implemented")
    return mean, std


def estimator(value: Any, full: dict) -> dict:
    """ROLL's gae whitens only with whiten_advantages (rlhf_jax's always does); its reinforce and grpo are the
    discounted return of the (normalised) scores, rlhf_jax's reinforce estimator with algorithm.reward_norm."""
    whiten = bool(get(full, "whiten_advantages"))
    if value not in ("gae", "reinforce", "grpo"):
        raise ValueError(f"adv_estimator={value!r}: ROLL's RLVR estimators here are gae, reinforce and grpo")
    mean, std = _norms(value, full)
    out = {_G + "reward_norm.mean": mean, _G + "reward_norm.std": std}
    if value == "gae":
        if not whiten:
            raise ValueError("adv_estimator=gae: rlhf_jax's GAE whitens its advantages; set whiten_advantages: true")
        return {**out, _G + "adv_estimator": "gae"}
    return {**out, _G + "adv_estimator": "reinforce", _G + "whiten_advantages": whiten}


def _difficulty(value: Any, full: dict) -> dict:
    if not value:
        return {_G + "sample_mask.difficulty": False}
    return {_G + "sample_mask.difficulty": True,
            _G + "sample_mask.difficulty_low": float(get(full, "difficulty_low_threshold", 0.0)),
            _G + "sample_mask.difficulty_high": float(get(full, "difficulty_high_threshold", 1.0))}


def _dual_clip(value: Any, full: dict) -> float:
    # ROLL bounds the loss of negative advantages at (1 + 2 pg_clip) |A|; off, the bound never applies
    return 1.0 + 2.0 * float(get(full, "pg_clip", 0.2)) if value else 1e30


def _bound(value: Any, _: dict) -> float | None:
    return None if value is None else float(value)


_UNREAD = "ROLL's RLVR pipeline reads no such setting"

RULES: tuple[Rule, ...] = (
    Rule("adv_estimator", convert=estimator),
    Rule("norm_mean_type", used_by="adv_estimator"),
    Rule("norm_std_type", used_by="adv_estimator"),
    Rule("whiten_advantages", used_by="adv_estimator"),
    Rule("dual_clip_loss", "actor_rollout_ref.actor.clip_ratio_c", _dual_clip),
    Rule("reward_clip", _G + "reward_clip", _bound),
    Rule("advantage_clip", _G + "advantage_clip", _bound),
    Rule("max_len_mask", _G + "sample_mask.truncated", lambda v, _: bool(v)),
    Rule("difficulty_mask", convert=_difficulty),
    Rule("difficulty_low_threshold", used_by="difficulty_mask"),
    Rule("difficulty_high_threshold", used_by="difficulty_mask"),
    # fields ROLL declares and never reads, and keys of its documentation examples it has no field for
    *(Rule(name, reason=_UNREAD) for name in ("use_reward_scaling", "use_reward_norm")),
    *(Rule(name, reason=_UNREAD, accept=lambda v: not v) for name in ("reward_norm", "reward_shift", "reward_scale")),
    Rule("whiten_rewards", reason="whitening the rewards is not implemented", accept=lambda v: not v),
    *(Rule(name, reason="reward shaping of ROLL's is not implemented", accept=lambda v: not v)
      for name in ("add_len_reward", "difficulty_loss_weight", "length_loss_weight",
                   "postive_loss_coef", "use_topr_neg_loss_coef", "use_topr_loss", "balance_length",
                   "error_max_len_clip")),
)
