"""``trainer.profile_steps``: a ``jax.profiler`` trace of the listed training steps.

Each listed step gets its own directory ``<profile_dir>/step_<n>`` holding what
``jax.profiler.start_trace`` writes (``plugins/profile/<run>/<host>.xplane.pb``
and a Perfetto trace), so TensorBoard's profile tab opened on ``profile_dir``
lists the steps as runs. Every process writes its own host's file. The step's
stages block on their outputs (the trainer's timers do), so the trace ends
after the step's device work, not after its dispatch.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator

import jax

log = logging.getLogger(__name__)


class StepProfiler:
    """Starts and stops ``jax.profiler`` around the steps in ``steps`` (1-based step numbers, as logged)."""

    def __init__(self, steps: Iterable[int] | None, directory: str):
        self.steps = frozenset(int(s) for s in steps or ())
        self.directory = os.path.abspath(os.path.expanduser(directory))

    def trace_dir(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step}")

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Trace the body when ``step`` is listed; otherwise do nothing."""
        if step not in self.steps:
            yield
            return
        path = self.trace_dir(step)
        os.makedirs(path, exist_ok=True)
        jax.profiler.start_trace(path, create_perfetto_trace=True)
        try:
            yield
        finally:
            jax.profiler.stop_trace()
            log.info("profile of step %d written to %s", step, path)
