"""Environment variables a config sets for its run (``trainer.env_vars``; ROLL's ``system_envs``).

A variable only takes effect if it is in the environment before its reader looks: JAX reads its ``JAX_*`` flags
when it is imported and ``XLA_FLAGS`` when its backend starts, ``huggingface_hub`` and ``transformers`` read
``HF_*`` when imported, OpenMP and glibc read theirs when the process starts. The config is parsed after some of
these imports, so a command that would change a variable restarts itself once (``os.execve`` of the same command
line) with the variables set: the new process sees them from its first instruction, exactly as if the shell had set
them. A call that cannot restart (``main()`` run from Python) sets the variables whose readers have not started yet
and refuses, by name, one whose reader already has.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from rlhf_jax.config.names import ENV_RESTART_MARK

# Set on the restarted process, so that a variable something resets in between cannot restart it twice (and the
# file's ignored-keys warning is not repeated).
RESTARTED = ENV_RESTART_MARK

# Variables read once, at process start, by the C runtime, the loader, OpenMP or Python itself.
_AT_START = ("GLIBC_", "LD_", "MALLOC_", "OMP_", "MKL_", "OPENBLAS_", "PYTHON")


def pending(wanted: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables of ``wanted`` whose value differs from ``environ``'s."""
    return {name: str(value) for name, value in wanted.items() if environ.get(name) != str(value)}


def _jax_backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # a JAX without this module: assume the worst
        return True
    return bool(getattr(xla_bridge, "_backends", True))


def reader_started(name: str) -> str | None:
    """What in this process has already read variable ``name`` (so setting it now changes nothing), or None."""
    if name.startswith(_AT_START):
        return "the process at its start"
    if name.startswith("JAX_") and "jax" in sys.modules:
        return "JAX when it was imported"
    if (name == "XLA_FLAGS" or name.startswith("TF_CPP_")) and _jax_backend_started():
        return "XLA when its backend started"
    if name.startswith(("HF_", "HUGGINGFACE_")) and "huggingface_hub" in sys.modules:
        return "huggingface_hub when it was imported"
    if name.startswith("TRANSFORMERS_") and "transformers" in sys.modules:
        return "transformers when it was imported"
    return None


def apply(wanted: Mapping[str, str] | None, *, command: list[str] | None) -> None:
    """Put ``wanted`` into this process's environment, when needed by running ``command`` (the command line that
    started this run; None: no restart) in this process's place; print the list. ValueError naming a variable
    that can no longer take effect."""
    if not wanted:
        return
    todo = pending(wanted)
    if todo and command and os.environ.get(RESTARTED) != "1":
        env = {**os.environ, **todo, RESTARTED: "1"}
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(command[0], command, env)  # does not return
    for name in todo:
        reader = reader_started(name)
        if reader is not None:
            raise ValueError(f"trainer.env_vars.{name}: {name} was already read by {reader}, so setting it now "
                             f"would change nothing; set {name} in the shell that starts the run")
    os.environ.update(todo)
    listed = ", ".join(f"{name}={value}" for name, value in sorted(wanted.items()))
    print(f"environment of the run (trainer.env_vars): {listed}", file=sys.stderr, flush=True)
