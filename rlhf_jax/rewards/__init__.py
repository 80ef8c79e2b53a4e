"""Rewards: rule-based scorers by data_source, custom functions from a file, reward-model scoring.

This package imports no JAX at import time (worker processes of the ``prime``
reward manager import it); the array helpers (``place_on_last_token``,
``overlong_penalty``) and ``RewardModelScorer`` load on first use.
"""

from typing import Any

from rlhf_jax.rewards.custom import (RewardLoadError, ScoreSpec, load_function_from_file, normalize_result,
                                     spec_from_config)
from rlhf_jax.rewards.manager import RewardFunctionError, RewardManager, RewardResult
from rlhf_jax.rewards.registry import check_data_sources, default_compute_score, register_scorer, scorer_name

_LAZY = {
    "place_on_last_token": "rlhf_jax.rewards.shaping",
    "overlong_penalty": "rlhf_jax.rewards.shaping",
    "RewardModelScorer": "rlhf_jax.rewards.reward_model",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlhf_jax.rewards' has no attribute {name!r}")


__all__ = [
    "RewardFunctionError", "RewardLoadError", "RewardManager", "RewardModelScorer", "RewardResult", "ScoreSpec",
    "check_data_sources", "default_compute_score", "load_function_from_file", "normalize_result",
    "overlong_penalty", "place_on_last_token", "register_scorer", "scorer_name", "spec_from_config",
]
