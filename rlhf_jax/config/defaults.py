"""Every default that depends on another key, filled once: the ``None`` = "same as ..." keys and the computed ones.

A key whose default is another key's value says so in the key table (``Key(..., same_as=path)``); a default
computed from several keys is one entry of :data:`COMPUTED`. :func:`fill_defaults` resolves both recursively
(a ``same_as`` chain may end in a computed key), so the order of the table does not matter. Consumers read the
filled config and never default again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ml_collections import ConfigDict

from rlhf_jax import algos
from rlhf_jax.config import schema

Get = Callable[[str], Any]  # the complete value of a key (filled on first read)
_A = "actor_rollout_ref."


def _critic_enable(get: Get, given: Get) -> bool:
    """A value model is trained when the estimator needs one, by the RL trainer only (SFT and DPO have none)."""
    name = get("algorithm.adv_estimator")  # an unknown name is refused by the key's own rule, after the defaults
    return name in algos.ADV_ESTIMATORS and algos.estimator_info(name).needs_critic and get("algorithm.type") == "rl"


def _critic_revision(get: Get, given: Get) -> str | None:
    """The actor's revision when the critic starts from the actor's checkpoint."""
    return get(_A + "model.revision") if given("critic.model.path") is None else None


def _critic_token_budget(get: Get, given: Get) -> int:
    """verl: twice the actor's budget (a value pass has no vocabulary projection); -1 stays -1."""
    budget = get(_A + "actor.ppo_max_token_len_per_gpu")
    return budget if budget == -1 else 2 * budget


def _max_actor_ckpt(get: Get, given: Get) -> int | None:
    return 1 if get("trainer.remove_previous_ckpt_in_save") else None


COMPUTED: dict[str, tuple[Callable[[Get, Get], Any], str]] = {
    "critic.enable": (_critic_enable, "the estimator needs a value model and algorithm.type=rl"),
    "critic.model.revision": (_critic_revision, "the actor's model.revision when critic.model.path is unset"),
    "critic.ppo_max_token_len_per_gpu": (_critic_token_budget, "2 x actor.ppo_max_token_len_per_gpu (-1 stays -1)"),
    _A + "actor.loss_scale_factor": (lambda get, given: float(get(_A + "rollout.response_length")),
                                     "rollout.response_length"),
    "reward_model.max_length": (lambda get, given: get("data.max_prompt_length") + get(_A + "rollout.response_length"),
                                "data.max_prompt_length + rollout.response_length"),
    "trainer.max_actor_ckpt_to_keep": (_max_actor_ckpt, "1 with trainer.remove_previous_ckpt_in_save, else None (all)"),
}


def fill_defaults(cfg: ConfigDict) -> None:
    """Fill, in place, every key left ``None`` that has a ``same_as`` or a computed default."""
    given = {path: value for path, value in schema.iter_leaves(cfg)}
    done: dict[str, Any] = {}

    def get(path: str) -> Any:
        if path in done:
            return done[path]
        value = given[path]
        if value is None:
            key = schema.get_key(path)
            if key.same_as is not None:
                value = get(key.same_as)
            elif path in COMPUTED:
                value = COMPUTED[path][0](get, given.__getitem__)
        done[path] = value
        return value

    for key in schema.KEYS:
        if given[key.path] is None and (key.same_as is not None or key.path in COMPUTED):
            schema.set_path(cfg, key.path, get(key.path))


def default_source(path: str) -> str | None:
    """Where the default of ``path`` comes from, in words (docs), or None for a plain default."""
    key = schema.get_key(path)
    if key.same_as is not None:
        return f"`{key.same_as}`"
    return COMPUTED[path][1] if path in COMPUTED else None
