"""Programs shared by every owner in the process: one jitted or compiled program per description.

A training role or a sampler builds its programs from values (a model's graph definition, a mesh, shardings, a
loss's settings, shapes). Two owners that describe a program alike (the second trainer of a run's stages, a
validation sampler, the trainers a test suite builds one after another) would trace, lower and load it again:
JAX's own caches key a jitted function by the Python function object, and each owner makes its own closures. The
store keys a program by the values it was built from, so an owner finds what another built.

A key must hold everything the program was built from. The owners build theirs from hashable values only (an
optimizer is keyed by the very object ``train.optim.make_optimizer`` returns for equal settings), and JAX's
process-wide settings that change what a trace produces are added here.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Hashable

import jax

# Compiled programs hold only their code (the arrays they read are arguments), and a run builds a few dozen.
CAPACITY = 128

_store: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
_lock = threading.Lock()


class Described:
    """A hashable description computed once (hashing a model's graph and shardings on every lookup is not free)."""

    __slots__ = ("parts", "_hash")

    def __init__(self, *parts: Hashable):
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Described) and self._hash == other._hash and self.parts == other.parts


def tree_description(tree: Any) -> tuple:
    """A pytree's structure and leaves (shardings, shapes) as a hashable value."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(leaves)


def shared(key: Hashable, make: Callable[[], Any]) -> Any:
    """The program stored under ``key``, made (and stored) on first use."""
    key = (key, jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision)
    with _lock:
        if key in _store:
            _store.move_to_end(key)
            return _store[key]
    program = make()  # outside the lock: a compile takes seconds, and another thread may need another program
    with _lock:
        _store[key] = program
        while len(_store) > CAPACITY:
            _store.popitem(last=False)
    return program


def compile_example(fn: Any, example: tuple) -> Any:
    """``fn`` (a jitted function) compiled ahead of time for arguments shaped like ``example``."""
    return fn.lower(*example).compile()


def clear() -> None:
    """Forget every stored program (their memory goes once no owner holds them)."""
    with _lock:
        _store.clear()
