"""Stopping on SIGTERM or SIGINT (Ctrl-C) without losing work.

A preemptible TPU VM or spot GPU gets SIGTERM some time before it goes away. The first SIGTERM or
SIGINT only sets a flag; the trainer reads it at safe points (before a step, after the rollout,
before the advantages, between validation batches), abandons a step that has not started changing
weights or finishes one that has, writes a checkpoint of the last finished step, flushes its logs and
exits 0. So the stop takes at most the rest of one rollout or of one step's updates (or one
validation batch), plus one checkpoint write. A second signal exits at once with 128 + its number;
the previous complete checkpoint stays intact (checkpoints are written atomically).

With several processes the flag is summed over processes at every safe point, so all processes
stop at the same point even when the signal reaches them at different times.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import numpy as np

from rlhf_jax.parallel.hosts import sum_over_processes

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StepAbandoned(Exception):
    """Raised inside a step that a stop request ends before it changed any state."""


class StopRequest:
    """The stop flag and the signal handlers that set it."""

    def __init__(self):
        self.signum: int | None = None
        self._depth = 0
        self._previous: dict[int, object] = {}

    @contextlib.contextmanager
    def installed(self):
        """Handle SIGTERM/SIGINT while inside (re-entrant; a no-op outside the main thread, where Python
        cannot install handlers)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        if self._depth == 0:
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0:
                for s, handler in self._previous.items():
                    signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            print(f"{name} again: stopping now; the last complete checkpoint is kept", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print(f"{name} received: stopping after the current step with a checkpoint "
              f"(send it again to stop at once)", file=sys.stderr, flush=True)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "a signal to another process"

    def agreed(self) -> bool:
        """True when any process received a signal. Every process must call this at the same points."""
        local = np.asarray([0 if self.signum is None else self.signum], np.int64)
        return bool(sum_over_processes(local)[0])


# One per process: main installs it before the model is loaded, the trainer's loop reads it.
STOP = StopRequest()
