"""One configuration key: dotted path, default, type, one-line doc, allowed values, and its single-key rule.

A rule that reads one key only is declared with that key (``check=``); rules between keys are named functions in
:mod:`rlhf_jax.config.rules`. Both run on the complete config (after the ``None`` = "same as ..." defaults are
filled), before any derived size is computed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Check:
    """A rule on one value: ``ok(value)`` or the error ``"<key>=<value!r><says>"``."""

    ok: Callable[[Any], bool]
    says: str  # the tail of the message, e.g. " must be >= 1"; for docs alone when ``explain`` is given
    explain: Callable[[Any], str] | None = None  # the whole message for a failing value, when it varies

    def message(self, path: str, value: Any) -> str:
        return self.explain(value) if self.explain is not None else f"{path}={value!r}{self.says}"


def at_least(minimum: float, why: str = "") -> Check:
    return Check(lambda v: v >= minimum, f" must be >= {minimum}{why}")


def above(bound: float, why: str = "") -> Check:
    return Check(lambda v: v > bound, f" must be > {bound}{why}")


def within(low: float, high: float) -> Check:
    return Check(lambda v: low <= v <= high, f" must be in [{low}, {high}]")


def fraction() -> Check:
    """A probability mass such as top_p: in (0, 1]."""
    return Check(lambda v: 0 < v <= 1, " must be in (0, 1]")


def micro_size() -> Check:
    """A ``*_micro_batch_size_per_gpu``: a count, or -1 for the whole per-shard batch."""
    return Check(lambda v: v >= 1 or v == -1, " must be >= 1, or -1 for the whole per-shard batch")


def finite_non_negative() -> Check:
    """A rate or coefficient of an update: a negative one ascends the loss, NaN/inf wreck the weights."""
    return Check(lambda v: math.isfinite(v) and v >= 0, " must be a finite number >= 0")


def registered(path: str, check: Callable[[str], None]) -> Check:
    """A name of an open registry (``check`` raises ValueError or KeyError listing the registered names)."""
    def problem(name: str) -> str | None:
        try:
            check(name)
        except (ValueError, KeyError) as e:
            return f"{path}={name!r} is not valid: {e}"
        return None

    return Check(lambda v: problem(v) is None, ": a registered name", problem)


def step_numbers() -> Check:
    return Check(lambda v: all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in v or ()),
                 ": give step numbers >= 1 (as logged), e.g. (2, 3)")


@dataclasses.dataclass(frozen=True)
class Key:
    """One configuration key."""

    path: str  # dotted, e.g. "actor_rollout_ref.actor.optim.lr"
    default: Any
    doc: str
    type: type | None = None  # required when default is None; otherwise type(default)
    choices: tuple[Any, ...] | None = None  # allowed values (for tuples: allowed elements)
    check: Check | None = None  # the key's own rule (None passes when the default is None: unset)
    check_if: str | None = None  # check only when this boolean key is true (e.g. "critic.enable")
    same_as: str | None = None  # a default of None takes this key's (complete) value

    @property
    def value_type(self) -> type:
        return self.type if self.type is not None else type(self.default)

    def rules(self) -> list[str]:
        """What is checked of this key alone, in words (for docs/CONFIG.md)."""
        out = []
        if self.choices is not None:
            out.append("one of the listed values")
        if self.check is not None:
            said = self.check.says.strip().removeprefix(":").strip()
            out.append(said + (f" (when {self.check_if})" if self.check_if else ""))
        return out

    def failure(self, value: Any) -> str | None:
        """The error message for ``value``, or None when it passes the key's own rules."""
        if self.choices is not None and value is not None:
            for v in value if isinstance(value, tuple) else (value,):
                if v not in self.choices:
                    return f"{self.path}={v!r} is not valid; choose from {', '.join(map(str, self.choices))}"
        if self.check is None:
            return None
        if value is None:
            return None if self.default is None else self.check.message(self.path, value)
        return None if self.check.ok(value) else self.check.message(self.path, value)
