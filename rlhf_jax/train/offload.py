"""Arrays kept in host memory between programs (verl's ``param_offload`` / ``optimizer_offload``).

An offloaded tree's arrays carry shardings of the host memory kind (``pinned_host``): they hold no device memory
between programs. A program that reads them takes them in host memory and copies them to the devices as the first
thing it does (:func:`on_devices`); an update program's outputs keep the host memory kind, so XLA writes the updated
arrays back to host memory at its end. Everything here is decided by the shardings' memory kinds, so a role whose
arrays are shared with another (the reference over a LoRA actor's base weights) follows their placement.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

HOST_MEMORY = "pinned_host"  # a memory kind of every JAX backend (CPU, GPU, TPU)
HOST_KINDS = (HOST_MEMORY, "unpinned_host")


def in_host(sharding: Any) -> bool:
    return getattr(sharding, "memory_kind", None) in HOST_KINDS


def any_in_host(shardings: Any) -> bool:
    return any(in_host(s) for s in jax.tree.leaves(shardings))


def to_host(shardings: Any) -> Any:
    return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings)


def to_device(shardings: Any) -> Any:
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def place(tree: Any, shardings: Any) -> Any:
    """``tree`` put at ``shardings``: real arrays moved (no copy where they are there already), abstract ones
    (``ShapeDtypeStruct``, compiling for another target) given the shardings."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree)):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
    return jax.device_put(tree, shardings)


def on_devices(tree: Any, shardings: Any) -> Any:
    """Inside a program: the arrays of ``tree`` whose ``shardings`` are in host memory, copied to the devices (same
    layout); the others as they are."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind("device")) if in_host(s) else x,
                        tree, shardings)


def reading_on_devices(fn: Callable, *arg_shardings: Any) -> Callable:
    """``fn`` whose first ``len(arg_shardings)`` arguments are copied to the devices where their shardings are in
    host memory (``fn`` itself when none is)."""
    if not any(any_in_host(s) for s in arg_shardings):
        return fn
    n = len(arg_shardings)

    def wrapped(*args):
        return fn(*(on_devices(a, s) for a, s in zip(args[:n], arg_shardings)), *args[n:])

    return wrapped


def device_copy(tree: Any) -> Any:
    """A copy of ``tree``'s host-memory arrays on the devices (the others as they are): for a reader outside the
    role's programs (the sampler), freed when the reader drops it."""
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    if not any_in_host(shardings):
        return tree
    return jax.device_put(tree, to_device(shardings))
