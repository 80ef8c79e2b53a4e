"""Quiet the storage library's noise around a failed checkpoint read or write.

A failed restore or save is reported to the user in one line (``runtime.checkpoint.CheckpointError``). What the
storage library prints besides it, from threads and garbage-collected futures still in flight, is not the user's
concern: this module drops exactly that noise and lets everything else through.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import time

# What the storage library prints when reads or writes still in flight after a failed restore or save complete
# into Orbax's already closed event loop: harmless, and not the user's concern (the failure itself is reported).
_CLOSED_LOOP_NOISE = re.compile(
    r"Traceback \(most recent call last\):|File \"[^\"]*asyncio/base_events\.py\", line \d+, in \w+|"
    r"self\._check_closed\(\)|raise RuntimeError\('Event loop is closed'\)|RuntimeError: Event loop is closed|"
    r"RuntimeError|: Event loop is closed")
_TRACEBACK = "Traceback (most recent call last):"


class _NoiseFilter:
    """A stand-in for sys.stderr that drops lines made only of closed-event-loop noise.

    Several storage threads write at once, so their tracebacks arrive cut and interleaved: the filter works
    line by line. A traceback header is held until the next line shows whose it is, so that any other
    traceback still prints whole."""

    def __init__(self, stream):
        self.stream, self.pending, self.header = stream, "", False
        self.lock = threading.Lock()  # the storage threads and the main thread write at once

    def write(self, text: str) -> int:
        with self.lock:
            return self._write(text)

    def _write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        # a traceback that began in the middle of another writer's line: that line, then the traceback's header
        lines = [part for line in lines for part in
                 ([line] if line.find(_TRACEBACK) <= 0 else [line[:line.find(_TRACEBACK)], _TRACEBACK])]
        for line in lines:
            if line.strip() == _TRACEBACK:
                self.header = True
            elif _CLOSED_LOOP_NOISE.sub("", line).strip():
                if self.header:
                    self.stream.write(_TRACEBACK + "\n")
                self.header = False
                self.stream.write(line + "\n")
            elif line.strip():
                self.header = False
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def drain(self, seconds: float = 1.0) -> None:
        """Give the reads still in flight time to finish while their noise is dropped."""
        time.sleep(seconds)

    def close(self) -> None:
        if _CLOSED_LOOP_NOISE.sub("", self.pending).strip():
            self.stream.write(self.pending)
        self.pending, self.header = "", False
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


class _OrbaxFailureFilter(logging.Filter):
    """Drops the logged reports of a failed Orbax read or write: the failure reaches the caller as an
    exception, which reports it in one line (CheckpointError).

    asyncio reports read tasks abandoned by a failed restore ("exception was never retrieved") when they are
    garbage-collected, possibly long after the restore; Orbax's writer threads log a failed write with its
    traceback (through absl) as it happens. Both go through the logging module, which holds the original
    stderr, so the stderr filter cannot see them.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[1] is None:
            return True
        if record.name == "asyncio" and "exception was never retrieved" not in record.getMessage():
            return True
        error = record.exc_info[1]
        return not (_raised_in_orbax(error.__traceback__) or _completed_by_tensorstore(error))


# A future that TensorStore completed carries no Python frame at all: its error is a status line (absl's code
# names), naming the store's spec or the OCDBT database it read.
_STORE_STATUS = re.compile(r"[A-Z][A-Z_]+: .*(tensorstore_spec|OCDBT database|zarr|Error (reading|opening|writing))",
                           re.DOTALL)


def _completed_by_tensorstore(error: BaseException) -> bool:
    return "tensorstore_spec" in str(error) or (error.__traceback__ is None
                                                and _STORE_STATUS.match(str(error)) is not None)


def _raised_in_orbax(tb) -> bool:
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _unraisable_hook(hook):
    """``sys.unraisablehook`` less the failures of Orbax's read coroutines: a failed restore leaves its other reads
    unfinished, and Python reports each (with TensorStore's many-line repr) when it is garbage-collected."""

    def hook_without_orbax(unraisable) -> None:
        if not _raised_in_orbax(unraisable.exc_traceback):
            hook(unraisable)

    hook_without_orbax.orbax_dropped = True
    return hook_without_orbax


_ORBAX_FAILURES = _OrbaxFailureFilter()


def _drop_logged_orbax_failures() -> None:
    for name in ("asyncio", "absl"):  # stays: the reports can come at any later time
        logging.getLogger(name).addFilter(_ORBAX_FAILURES)
    if not getattr(sys.unraisablehook, "orbax_dropped", False):
        sys.unraisablehook = _unraisable_hook(sys.unraisablehook)


def quiet_storage_noise_until_exit() -> None:
    """After a failed save the storage library's writer threads go on printing until the process ends (main then
    leaves with ``os._exit``): drop their noise from stderr from now on, the error line excepted."""
    _drop_logged_orbax_failures()
    if not isinstance(sys.stderr, _NoiseFilter):
        sys.stderr = _NoiseFilter(sys.stderr)


@contextlib.contextmanager
def quiet_storage_noise():
    """While restoring or saving, drop the storage library's closed-event-loop noise from stderr (see
    _CLOSED_LOOP_NOISE) and its logged failure reports (see _OrbaxFailureFilter)."""
    _drop_logged_orbax_failures()
    noise = _NoiseFilter(sys.stderr)
    sys.stderr = noise
    try:
        yield noise
    finally:
        sys.stderr = noise.stream
        noise.close()
