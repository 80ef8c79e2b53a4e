"""Running a scoring function with a per-call timeout: in a thread (naive) or in worker processes (prime).

Each call ends as an :class:`Outcome`: ``ok`` with a score and numeric extras,
``error`` with the traceback text, or ``timeout``. In-process calls run in
daemon threads that are joined with a deadline; a hung thread is abandoned (it
cannot be killed, so it keeps whatever CPU it uses; prefer the process pool for
untrusted functions). The process pool gives each worker one call at a time
and kills and replaces a worker that overruns its deadline or dies.

A scoring function that calls ``sys.exit`` raises ``SystemExit`` in its own call, which fails that call
only. ``os._exit`` would end the process at once, so while a call runs, ``os._exit`` raises
``SystemExit`` instead when called from that call's thread (:func:`guard_os_exit`); other threads
still exit for real. (Worker processes are not guarded: one that exits is replaced.) A crash below Python (a segfault, ``os.abort``) still ends an in-process call's
process: the process pool survives those too.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from rlhf_jax.rewards.custom import ComputeScore, RewardLoadError, ScoreSpec, normalize_result

WORKER_START_TIMEOUT_S = 120.0


@dataclasses.dataclass
class Outcome:
    status: str  # "ok" | "error" | "timeout"
    score: float = 0.0
    extras: dict[str, float] = dataclasses.field(default_factory=dict)
    message: str = ""


_in_call = threading.local()  # .active: this thread is running a scoring call
_real_os_exit = os._exit


def _os_exit_in_call(status: int) -> None:
    """``os._exit`` while the guard is installed: fails the scoring call that made it, exits anywhere else."""
    if getattr(_in_call, "active", False):
        raise SystemExit(f"os._exit({status}) called by the reward function")
    _real_os_exit(status)


def guard_os_exit() -> None:
    """Make ``os._exit`` called from a scoring call fail that call (idempotent). Installed before the user's
    module is imported, so that ``from os import _exit`` there binds the guarded function too."""
    os._exit = _os_exit_in_call


def _run_one(fn: ComputeScore, args: tuple) -> Outcome:
    _in_call.active = True
    try:
        score, extras = normalize_result(fn(*args))
        return Outcome("ok", score, extras)
    except BaseException:  # noqa: BLE001 - any failure of user code becomes a logged error
        return Outcome("error", message=traceback.format_exc(limit=5))
    finally:
        _in_call.active = False


def run_in_threads(fn: ComputeScore, calls: Sequence[tuple], timeout_s: float | None, max_parallel: int) -> list[Outcome]:
    """Call fn(*args) for each args tuple, at most `max_parallel` at a time, each limited to `timeout_s`."""
    guard_os_exit()
    if timeout_s is None:
        return [_run_one(fn, args) for args in calls]
    outcomes: list[Outcome] = [Outcome("timeout")] * len(calls)
    step = max(1, int(max_parallel))
    for start in range(0, len(calls), step):
        wave = []
        for i in range(start, min(start + step, len(calls))):
            box: dict[str, Outcome] = {}
            thread = threading.Thread(
                target=lambda b=box, a=calls[i]: b.__setitem__("out", _run_one(fn, a)), daemon=True,
                name=f"reward-call-{i}",
            )
            thread.start()
            wave.append((i, thread, box))
        deadline = time.monotonic() + timeout_s
        for i, thread, box in wave:
            thread.join(max(0.0, deadline - time.monotonic()))
            outcomes[i] = box.get("out", Outcome("timeout", message=f"no result within {timeout_s}s"))
    return outcomes


def _worker_main(conn: Connection, spec: ScoreSpec) -> None:
    """Worker process: load the function once, then answer (task_id, args) requests until told to stop."""
    # Ctrl-C reaches the whole process group: the trainer handles it and stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fn = spec.load()
    except RewardLoadError as e:  # already one line naming the file
        conn.send(("init_error", str(e)))
        return
    except BaseException:  # noqa: BLE001
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        task_id, args = msg
        out = _run_one(fn, args)
        conn.send((task_id, out.status, out.score, out.extras, out.message))


class _Worker:
    def __init__(self, ctx: Any, spec: ScoreSpec):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.task: int | None = None
        self.deadline = float("inf")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class ProcessPool:
    """Worker processes that score one call at a time each; hung or dead workers are replaced."""

    def __init__(self, spec: ScoreSpec, num_workers: int = 4, start_method: str = "spawn"):
        if num_workers <= 0:
            raise ValueError(f"reward_model.num_workers must be positive, got {num_workers}")
        self.spec = spec
        self._ctx = mp.get_context(start_method)
        self._workers = [_Worker(self._ctx, spec) for _ in range(num_workers)]
        self.num_replaced = 0

    def _replace(self, k: int) -> None:
        self._workers[k].kill()
        self._workers[k] = _Worker(self._ctx, self.spec)
        self.num_replaced += 1

    def map(self, calls: Sequence[tuple], timeout_s: float | None) -> list[Outcome]:
        """Score every call; each gets `timeout_s` from the moment a ready worker receives it."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = collections.deque(range(len(calls)))
        while pending or any(w.task is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    w.task = pending.popleft()
                    w.conn.send((w.task, calls[w.task]))
                    w.deadline = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
            now = time.monotonic()
            next_deadline = min(
                [w.deadline for w in self._workers if w.task is not None]
                + [w.started + WORKER_START_TIMEOUT_S for w in self._workers if not w.ready]
            )
            ready_conns = wait([w.conn for w in self._workers], timeout=max(0.0, min(next_deadline - now, 1.0)))
            for k, w in enumerate(self._workers):
                if w.conn in ready_conns:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        if w.task is not None:
                            outcomes[w.task] = Outcome(
                                "error", message=f"reward worker died (exit code {w.proc.exitcode})")
                            w.task = None
                        self._replace(k)
                        continue
                    if msg[0] == "ready":
                        w.ready = True
                    elif msg[0] == "init_error":
                        self.close()
                        raise RewardLoadError(f"reward worker could not load the scoring function: {msg[1]}")
                    else:
                        task_id, status, score, extras, message = msg
                        outcomes[task_id] = Outcome(status, score, extras, message)
                        w.task = None
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                if w.task is not None and now > w.deadline:
                    outcomes[w.task] = Outcome("timeout", message=f"no result within {timeout_s}s; worker replaced")
                    w.task = None
                    self._replace(k)
                elif not w.ready and now > w.started + WORKER_START_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(f"reward worker did not start within {WORKER_START_TIMEOUT_S}s")
        return [o if o is not None else Outcome("error", message="lost") for o in outcomes]

    def close(self) -> None:
        for w in self._workers:
            try:
                if w.ready and w.task is None:
                    w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for w in self._workers:
            w.proc.join(1)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)
            w.conn.close()
        self._workers = []

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]
