"""Environments: ``reset(task) -> observation`` and ``step(action) -> (observation, reward, done, info)``, registered
by name or loaded from a user's file, and the reply function that puts one into the multi-turn loop.

An environment's observations reach the model as ``user`` messages rendered by the chat template (not trained,
like tool responses); its rewards are recorded per turn on the trajectory. Built-in: ``guess_number``, a game
whose reward needs several moves (the model hears "higher" / "lower" after each guess).

Load one with ``load_environment("guess_number")`` or ``load_environment("/path/to/envs.py:MyEnv")`` (a class
with a no-argument constructor); a missing file or class is a one-line ``ValueError`` naming ``key``.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import Callable

from rlhf_jax.agents.loading import load_from_file
from rlhf_jax.agents.turns import Reply, ReplyFn


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
    """Base class of environments; one instance plays one trajectory."""

    @abc.abstractmethod
    def reset(self, task: dict) -> str:
        """Start the trajectory of ``task`` (a data row); returns the first observation (the user's message)."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Answer the model's turn ``action``: the next observation, this turn's reward, whether it is over."""


_ENVIRONMENTS: dict[str, type] = {}


def register_environment(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        _ENVIRONMENTS[name] = cls
        return cls
    return deco


def environment_names() -> tuple[str, ...]:
    return tuple(sorted(_ENVIRONMENTS))


def load_environment(spec: str, key: str = "environment") -> type:
    """The environment class a registered name or ``path.py:ClassName`` names."""
    if ":" not in spec:
        if spec not in _ENVIRONMENTS:
            raise ValueError(f"{key}={spec!r} is not a registered environment (registered: "
                             f"{', '.join(environment_names())}); or give path/to/file.py:ClassName")
        return _ENVIRONMENTS[spec]
    cls = load_from_file(spec, key)
    if not isinstance(cls, type):
        raise ValueError(f"{key}: {spec.rsplit(':', 1)[0]} defines no class named {spec.rsplit(':', 1)[1]!r}")
    return cls


def environment_reply(env: Environment) -> ReplyFn:
    """Each turn's text is the environment's action; its observation follows as a user message."""
    def reply(text: str, last_turn: bool) -> Reply:
        result = env.step(text)
        return Reply([{"role": "user", "content": result.observation}], done=bool(result.done),
                     reward=float(result.reward))
    return reply


_INTEGER = re.compile(r"-?\d+")


@register_environment("guess_number")
class GuessNumber(Environment):
    """Find ``secret`` in [low, high]; each move is the last integer of the model's turn. Reward 1 for the right
    number (the game ends), 0 otherwise; ``max_moves`` guesses at most."""

    def reset(self, task: dict) -> str:
        secret = task["secret"] if "secret" in task else task["ground_truth"]  # a data row's ground truth
        self.secret, self.low, self.high = int(secret), int(task.get("low", 1)), int(task.get("high", 100))
        self.max_moves, self.moves = int(task.get("max_moves", 8)), 0
        return (f"I am thinking of an integer between {self.low} and {self.high}. Guess it: answer with one number; "
                "I will say higher or lower.")

    def step(self, action: str) -> StepResult:
        self.moves += 1
        found = _INTEGER.findall(action)
        out_of_moves = self.moves >= self.max_moves
        if not found:
            return StepResult("Answer with one integer.", 0.0, out_of_moves, {"valid": False})
        guess = int(found[-1])
        if guess == self.secret:
            return StepResult("Correct!", 1.0, True, {"moves": self.moves})
        hint = "Higher." if guess < self.secret else "Lower."
        return StepResult(hint, 0.0, out_of_moves, {"moves": self.moves})


def make_environments(cls: type | None, tasks: list[dict], named: dict | None = None,
                      key: str = "environments") -> tuple[list[Environment], list[str]]:
    """One environment per task, reset; their first observations. A task whose ``env`` is a name in ``named``
    (``{name: {"environment": spec, ...}}``) plays that environment, with its entry as ``task["env_config"]``;
    any other task plays ``cls``."""
    named = named or {}
    envs, tasks_out = [], []
    for task in tasks:
        name = task.get("env")
        if name is not None and name in named:
            entry = dict(named[name])
            envs.append(load_environment(str(entry["environment"]), f"{key}.{name}.environment")())
            tasks_out.append({**task, "env_config": entry})
        elif cls is not None:
            envs.append(cls())
            tasks_out.append(task)
        else:
            raise ValueError(f"a task names environment {name!r}, which {key} does not define (defined: "
                             f"{', '.join(sorted(named)) or 'none'})")
    return envs, [env.reset(task) for env, task in zip(envs, tasks_out)]


__all__ = ["Environment", "GuessNumber", "StepResult", "environment_names", "environment_reply", "load_environment",
           "make_environments", "register_environment"]
