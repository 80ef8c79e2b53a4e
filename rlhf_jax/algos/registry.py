"""Name -> function registries, so a config string selects an algorithm piece.

Users extend the framework with a decorator, e.g.::

    @register_adv_estimator("my_est")
    def my_est(*, token_level_rewards, response_mask, **_): ...

and select it with ``algorithm.adv_estimator=my_est``. Unknown names raise a
``ValueError`` that lists the registered ones; ``Registry.check`` validates a
name without computing anything, so a config can be checked before compilation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry:
    """A named table of functions plus optional per-entry metadata."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._fns: dict[str, Callable[..., Any]] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, *, overwrite: bool = False, **meta: Any) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``; re-registering a different function needs ``overwrite``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            if name in self._fns and self._fns[name] is not fn and not overwrite:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({self._fns[name]!r}); pass overwrite=True to replace it"
                )
            self._fns[name] = fn
            self._meta[name] = dict(meta)
            return fn

        return decorator

    def check(self, name: str) -> None:
        """Raise ValueError (naming the config key and the registered names) if ``name`` is unknown."""
        if name not in self._fns:
            raise ValueError(
                f"unknown {self.kind} {name!r} (config key {self.config_key}); registered: {', '.join(self.names())}"
            )

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered under ``name``."""
        self.check(name)
        return self._fns[name]

    def meta(self, name: str) -> dict[str, Any]:
        """Metadata given at registration (e.g. a forced aggregation mode)."""
        self.check(name)
        return dict(self._meta[name])

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._fns))

    def __contains__(self, name: object) -> bool:
        return name in self._fns


ADV_ESTIMATORS = Registry("advantage estimator", "algorithm.adv_estimator")
POLICY_LOSSES = Registry("policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode")
KL_ESTIMATORS = Registry(
    "KL estimator", "algorithm.kl_penalty / actor_rollout_ref.actor.kl_loss_type"
)


@dataclasses.dataclass(frozen=True)
class EstimatorInfo:
    """What an advantage estimator needs from the rest of the loop (asked by config checks and the trainer)."""

    grouped: bool = False  # compares the samples of one prompt: rollout.n >= 2, else every advantage is 0
    needs_critic: bool = False  # reads values: a value model is trained (critic.enable defaults to this)
    needs_greedy_baseline: bool = False  # reads reward_baselines: one greedy rollout per prompt batch (ReMax)
    # reads old_log_probs and sum_pi_squared: the old-log-prob pass runs and also returns sum_v pi_v^2 per token
    needs_sum_pi_squared: bool = False


def register_adv_estimator(name: str, *, overwrite: bool = False, grouped: bool = False, needs_critic: bool = False,
                           needs_greedy_baseline: bool = False,
                           needs_sum_pi_squared: bool = False) -> Callable[[F], F]:
    """Register an advantage estimator ``fn(*, token_level_rewards, response_mask, group_ids, values, gamma, lam, **options) -> (advantages, returns)``.

    ``grouped``, ``needs_critic``, ``needs_greedy_baseline`` and ``needs_sum_pi_squared`` describe what it needs
    (:class:`EstimatorInfo`).
    """
    info = EstimatorInfo(grouped=grouped, needs_critic=needs_critic, needs_greedy_baseline=needs_greedy_baseline,
                         needs_sum_pi_squared=needs_sum_pi_squared)
    return ADV_ESTIMATORS.register(name, overwrite=overwrite, info=info)


def estimator_info(name: str) -> EstimatorInfo:
    """What the registered estimator ``name`` needs; ValueError naming algorithm.adv_estimator if unknown."""
    return ADV_ESTIMATORS.meta(name)["info"]


def register_policy_loss(name: str, *, overwrite: bool = False, agg_mode: str | None = None) -> Callable[[F], F]:
    """Register a policy loss ``fn(*, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, ...) -> (loss, metrics)``.

    ``agg_mode`` forces an aggregation mode regardless of the configured one (GSPO uses seq-mean-token-mean).
    """
    return POLICY_LOSSES.register(name, overwrite=overwrite, agg_mode=agg_mode)


def register_kl_estimator(name: str, *, overwrite: bool = False) -> Callable[[F], F]:
    """Register a per-token KL estimator ``fn(logprob, ref_logprob) -> kl``."""
    return KL_ESTIMATORS.register(name, overwrite=overwrite)
