"""Every process of a split run watches the others, so that a peer that dies or stalls stops the whole run within a
bound, each process with one line naming the peer and what it was doing: no hang, ever.

Why not leave it to the distributed runtime: its heartbeats notice a dead process too, but they end every other
process with a fatal C++ abort and a stack dump, and a process blocked in a collective with the dead one (gloo,
NCCL) waits until then. Here a daemon thread of each process, once a second and in one call to the key-value store:

- counts its own sign of life (``alive/<process>``),
- reads the others' counts: a count that has not moved for ``silence_s`` seconds is a peer gone (killed, crashed,
  stopped, or its host lost); processes that finished (``done/<process>``) are not watched,
- reads the run's stop word (``abort``): the first process that finds a peer gone, or a hand-off that missed its
  deadline (parallel/handoff.py), writes it; every process prints it and leaves.

A store that cannot be reached means the coordinator (process 0) is gone. Leaving is ``os._exit``: a process
blocked in a collective with a dead peer cannot be unwound, and the checkpoints are safe (each is written under a
temporary name and renamed when complete). Process 0 hosts the store: before it leaves it waits a few seconds for
the others to read the stop word.

``silence_s`` is shorter than the runtime's own heartbeat timeout (RLHF_JAX_HEARTBEAT_TIMEOUT_S), so this line
comes first.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Sequence

PREFIX = "rlhf_jax/watch"
EXIT_CODE = 2


def _leave_process(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")  # one write: other threads' output cannot split the line
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_CODE)


class Watchdog:
    """This process's watch over ``peers`` (process indices)."""

    def __init__(self, peers: Sequence[int], silence_s: float, *, client=None, process: int | None = None,
                 interval_s: float = 1.0, leave: Callable[[str], None] = _leave_process):
        import jax

        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
        self.client, self.silence_s, self.interval_s, self._leave = client, float(silence_s), interval_s, leave
        self.process = jax.process_index() if process is None else process
        self.peers = tuple(p for p in peers if p != self.process)
        self._doing = "setting up"
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (its last count, when it last moved, local clock)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the process does now, named in the stop line ------------------------------------------------
    @contextlib.contextmanager
    def doing(self, what: str):
        before, self._doing = self._doing, what
        try:
            yield
        finally:
            self._doing = before

    def set_doing(self, what: str) -> None:
        self._doing = what

    # -- life cycle -----------------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        now = time.monotonic()
        self._seen = {p: ("", now) for p in self.peers}
        self._thread = threading.Thread(target=self._run, name="rlhf_jax-watchdog", daemon=True)
        self._thread.start()
        return self

    def finish(self) -> None:
        """This process is done (a normal end or a clean stop): the others stop watching it."""
        if self._done.is_set():
            return
        self._done.set()
        with contextlib.suppress(Exception):
            self.client.key_value_set(f"{PREFIX}/done/{self.process}", "1", allow_overwrite=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1)

    def abort(self, message: str) -> None:
        """Stop the run: publish ``message`` (the first published wins) and leave with it."""
        with contextlib.suppress(Exception):  # another process may have published first, or the store be gone
            self.client.key_value_set(f"{PREFIX}/abort", f"process {self.process}: {message}")
        with contextlib.suppress(Exception):
            message = self._published() or message
        self._stop_here(message)

    def await_verdict(self) -> None:
        """Give the watch time to find a peer gone (it then leaves the process with that line); returns if it
        finds none."""
        deadline = time.monotonic() + self.silence_s + 3 * self.interval_s
        while time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            time.sleep(self.interval_s / 4)

    # -- the watch ------------------------------------------------------------------------------------------
    def _published(self) -> str | None:
        for key, value in self.client.key_value_dir_get(f"{PREFIX}/"):
            if key.endswith("/abort"):
                return value
        return None

    def _stop_here(self, message: str) -> None:
        self._done.set()
        if self.process == 0:  # the store lives here: give the others time to read the stop word
            time.sleep(min(5.0, 3 * self.interval_s))
        self._leave(message)

    def check(self) -> None:
        """One look: count this process's sign of life, read the others' and the stop word; leave if needed."""
        self.client.key_value_increment(f"{PREFIX}/alive/{self.process}", 1)
        entries = dict(self.client.key_value_dir_get(f"{PREFIX}/"))
        stop = entries.get(f"{PREFIX}/abort")
        if stop is not None:
            self._stop_here(stop)
            return
        now = time.monotonic()
        for peer in self.peers:
            if f"{PREFIX}/done/{peer}" in entries:
                continue
            count = entries.get(f"{PREFIX}/alive/{peer}", "")
            last, since = self._seen[peer]
            if count != last:
                self._seen[peer] = (count, now)
            elif now - since > self.silence_s:
                self.abort(f"{self._doing}: process {peer} stopped responding (no sign of life for "
                           f"{self.silence_s:.0f} s); the run stops, and the same command resumes it from the last "
                           f"checkpoint")
                return

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                self.check()
            except Exception as e:  # the store is gone with process 0
                if self._done.is_set():
                    return
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                self._stop_here(f"{self._doing}: the run's coordinator (process 0) cannot be reached ({first}); "
                                f"the run stops, and the same command resumes it from the last checkpoint")
                return


_CURRENT: Watchdog | None = None


def install(watchdog: Watchdog) -> Watchdog:
    global _CURRENT
    _CURRENT = watchdog.start()
    return _CURRENT


def current() -> Watchdog | None:
    return _CURRENT


@contextlib.contextmanager
def doing(what: str):
    """Name what this process does now in the stop line of the installed watchdog (a no-op without one)."""
    if _CURRENT is None:
        yield
    else:
        with _CURRENT.doing(what):
            yield


# What a collective or transfer says when the process at its other end is gone (gloo, NCCL, sockets, gRPC).
_PEER_LOST = ("connection reset", "connection closed", "connection refused", "broken pipe", "socket closed",
              "end of file", "unavailable", "gloo", "nccl")


def lost_a_peer(error: BaseException) -> bool:
    """Whether ``error`` may come from a peer that went away rather than from this process's own work."""
    text = f"{type(error).__name__}: {error}".lower()
    return any(words in text for words in _PEER_LOST)


def set_doing(what: str) -> None:
    """What this process does from now on, for the installed watchdog's stop line (a no-op without one)."""
    if _CURRENT is not None:
        _CURRENT.set_doing(what)


def silence_limit_s(heartbeat_timeout_s: float) -> float:
    """How long a peer may stay silent: well under the runtime's heartbeat timeout (which can fire after about
    two thirds of it), so that this line, not the runtime's abort, ends the run."""
    return max(3.0, 0.4 * heartbeat_timeout_s)
