"""What a cross-key rule is: a named function ``fn(cfg, ctx)`` that raises one line naming the key, and the keys it
reads (for docs/CONFIG.md). The rules themselves are in :mod:`rlhf_jax.config.rules` and
:mod:`rlhf_jax.config.rules_run`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ml_collections import ConfigDict


@dataclasses.dataclass(frozen=True)
class Context:
    """What a rule may know beyond the config: the run's devices and processes, whether to look at files."""

    num_devices: int = 1
    num_processes: int = 1
    check_paths: bool = True


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    keys: tuple[str, ...]
    doc: str
    fn: Callable[[ConfigDict, Context], None]
    module: str  # where it is written (rules or rules_run)


GIVEN_RULES: list[Rule] = []
RULES: list[Rule] = []


def rule(*keys: str, given: bool = False):
    """Register ``fn(cfg, ctx)`` as a rule reading ``keys`` (on the config as written when ``given``)."""
    def register(fn):
        doc = (fn.__doc__ or fn.__name__).strip().split("\n")[0]
        (GIVEN_RULES if given else RULES).append(Rule(fn.__name__, keys, doc, fn, fn.__module__.rsplit(".", 1)[-1]))
        return fn
    return register


def rules_of(path: str) -> list[Rule]:
    """The cross-key rules that read ``path``."""
    return [r for r in GIVEN_RULES + RULES if path in r.keys]


def run_rules(cfg: ConfigDict, ctx: Context, rules: list[Rule]) -> None:
    """Run ``rules`` in order; the first failure raises."""
    for r in rules:
        r.fn(cfg, ctx)
