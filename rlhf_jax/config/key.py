"""One configuration key: dotted path, default, type, one-line doc, allowed values."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Key:
    """One configuration key."""

    path: str  # dotted, e.g. "actor_rollout_ref.actor.optim.lr"
    default: Any
    doc: str
    type: type | None = None  # required when default is None; otherwise type(default)
    choices: tuple[Any, ...] | None = None  # allowed values (for tuples: allowed elements)

    @property
    def value_type(self) -> type:
        return self.type if self.type is not None else type(self.default)
