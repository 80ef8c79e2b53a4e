"""The platform a program is compiled for: jax's default backend, or the target the ``plan`` command compiles for.

Code that chooses a kernel or a layout by platform (attention kernels, float32 dots, micro-batch sizing) asks
``compile_backend()`` rather than ``jax.default_backend()``, so that compiling for a TPU slice or a GPU node from
a CPU machine (``python -m rlhf_jax.plan``) traces the same choices a run on that hardware makes.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

_target: list[tuple[str, int | None]] = []  # the innermost ``compiling_for`` (platform, device count)


def compile_backend() -> str:
    """"cpu", "gpu" or "tpu": the platform programs traced now are meant for."""
    return _target[-1][0] if _target else jax.default_backend()


def compile_device_count() -> int:
    """Devices the programs traced now are meant for: the target's, or jax's."""
    return (_target[-1][1] or jax.device_count()) if _target else jax.device_count()


def platform_name(platform: str) -> str:
    """jax's backend name of a device platform ("cuda" and "rocm" devices form the "gpu" backend)."""
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


@contextlib.contextmanager
def compiling_for(platform: str, devices: int | None = None) -> Iterator[None]:
    """Within the block, ``compile_backend()`` is ``platform`` (a device platform such as "tpu" or "cuda") and
    ``compile_device_count()`` is ``devices`` (None: jax's)."""
    _target.append((platform_name(platform), devices))
    try:
        yield
    finally:
        _target.pop()
