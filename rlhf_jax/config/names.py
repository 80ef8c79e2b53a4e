"""Checks of algorithm names (estimators, losses, KL estimators, aggregation modes) before compilation.

The registries of :mod:`rlhf_jax.algos` are the source of truth, so names a
user registers with a decorator pass too. Each error names the exact config key.
"""

from __future__ import annotations

from collections.abc import Callable

# Estimators that compare the n samples of one prompt; with rollout.n == 1 every advantage is 0.
GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline")


def _checkers() -> dict[str, Callable[[str], None]]:
    from rlhf_jax import algos

    return {
        "adv_estimator": algos.check_adv_estimator,
        "policy_loss": algos.check_policy_loss,
        "kl": algos.check_kl_kind,
        "loss_agg_mode": algos.check_loss_agg_mode,
    }


def check_name(kind: str, name: str, key: str) -> None:
    """Raise ValueError ``"<key>=<name>: <registry message>"`` if ``name`` is not registered for ``kind``.

    ``kind`` is one of adv_estimator, policy_loss, kl, loss_agg_mode.
    """
    check = _checkers()[kind]
    try:
        check(name)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{key}={name!r} is not valid: {e}") from None
