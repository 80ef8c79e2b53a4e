"""Samples the chat clients' calls of a workflow's episodes in batches.

Every episode runs on its own thread and its client's calls wait here. In one process a call that finds no batch
running runs every queued call as one batch; the others wait for the next. Over several processes (a workflow's
episodes in a multi-process run, or on a split run's several sampling processes) every sampler program is one
program over all their devices, which all must run together, while each process's calls come whenever its user
code makes them: the episodes' thread then samples in rounds. A round starts when each of this process's running
episodes waits on a call (or none is left); every process then samples its queued calls (perhaps none) as one
batch as wide as the widest process's, until no process has an episode left. A row's tokens depend only on
(key, row id, token index), so neither the batching nor the rounds change what a client draws.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

import jax
import numpy as np

from rlhf_jax.parallel.hosts import all_rows, sum_over_processes
from rlhf_jax.rollout.buckets import next_power_of_two

T = TypeVar("T")
Sampled = tuple[list[int], list[float], bool, Any]  # token ids, their log-probs, stopped, routes (or None)


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    limit: int
    start: int
    row_id: int
    result: Sampled | None = None
    error: BaseException | None = None
    done: bool = False


class SamplerBroker:
    """The batches of the calls of clients on several threads (rows padded to a power of two times the sampler's
    shard count, so a few shapes compile). One batch at a time reaches the device
    (``ConversationSampler.device_lock``); ``batches`` counts them, ``calls`` the calls."""

    def __init__(self, sampler, state: Any, key: jax.Array, *, lockstep: bool = False):
        """``lockstep``: this process is one of several sampling together (``run_episodes`` samples the rounds)."""
        self.sampler, self.state, self.key = sampler, state, key
        self._cv = threading.Condition()
        self._queue: list[_Request] = []
        self._running = False
        self.lockstep = lockstep
        self._started = self._finished = 0
        self._failed: BaseException | None = None
        self.batches = 0
        self.calls = 0

    def sample(self, prompt: list[int], limit: int, start: int, row_id: int) -> Sampled:
        """(token ids, their log-probs, stopped at EOS / a stop sequence, the experts of the prompt's and the
        sampled tokens when the sampler records routes, else None) of one conversation's next turn."""
        request = _Request(prompt, limit, start, row_id)
        with self._cv:
            if self._failed is not None:
                raise self._failed
            self._queue.append(request)
            self._cv.notify_all()  # a round may be complete now
            while not request.done:
                if self._running or self.lockstep:  # in lockstep the rounds' thread samples
                    self._cv.wait()
                    continue
                batch, self._queue, self._running = self._queue, [], True
                self._cv.release()
                try:
                    self._finish(batch, *self._attempt(batch, len(batch)))
                finally:
                    self._cv.acquire()
                    self._running = False
                self._cv.notify_all()
        if request.error is not None:
            raise request.error
        return request.result

    def run_episodes(self, episodes: Sequence[Callable[[], T]], workers: int) -> list[T]:
        """Each episode's result, run on ``workers`` threads (an episode's exception is raised here). In lockstep
        this thread samples the rounds until no process has an episode left."""
        if not self.lockstep:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                return list(pool.map(lambda episode: episode(), episodes))
        total = len(episodes)

        def counted(episode: Callable[[], T]) -> T:
            with self._cv:
                self._started += 1
            try:
                return episode()
            finally:
                with self._cv:
                    self._finished += 1
                    self._cv.notify_all()

        def waiting() -> bool:  # every running episode waits on a call; a free thread means none is left to start
            running = self._started - self._finished
            return len(self._queue) == running and (running == workers or self._started == total)

        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(counted, episode) for episode in episodes]
            while True:
                with self._cv:
                    self._cv.wait_for(waiting)
                    batch, self._queue = self._queue, []
                    left = total - self._finished
                if not all_rows([left]).any():
                    break
                results, error = self._attempt(batch, int(all_rows([len(batch)]).max()))
                with self._cv:
                    self._failed = error  # later calls raise it: the processes' rounds are out of step
                    self._finish(batch, results, error)
                    self._cv.notify_all()
                if error is not None:
                    break
            return [f.result() for f in futures]

    def calls_per_batch(self) -> float:
        """Calls sampled per batch: every process's calls per round in lockstep."""
        calls = sum_over_processes(np.asarray([self.calls]))[0] if self.lockstep else self.calls
        return float(calls) / max(self.batches, 1)

    def _attempt(self, batch: list[_Request], rows: int) -> tuple[list[Sampled] | None, BaseException | None]:
        try:
            return self._run(batch, rows), None
        except BaseException as e:  # noqa: BLE001 - every caller in the batch gets it
            return None, e

    @staticmethod
    def _finish(batch: list[_Request], results: list[Sampled] | None, error: BaseException | None) -> None:
        for i, r in enumerate(batch):
            r.result, r.error, r.done = (results[i] if results else None), error, True

    def _run(self, batch: list[_Request], rows: int) -> list[Sampled]:
        """Sample ``batch`` as ``rows`` rows (at least its own; every process's are as many), padded further to a
        power of two times the sampler's shard count; padding rows draw nothing."""
        shards = self.sampler.shard_count(self.state)
        pad = shards * next_power_of_two(-(-rows // shards)) - len(batch)
        column = lambda name: [getattr(r, name) for r in batch] + [0] * pad  # noqa: E731
        with self.sampler.device_lock:
            conv = self.sampler.append(self.state, self.sampler.start(self.state, len(batch) + pad),
                                       [r.prompt for r in batch] + [[]] * pad)
            conv, out = self.sampler.decode(self.state, conv, column("limit"), column("start"), column("row_id"),
                                            self.key)
            # every sampled token went through the cache too (a next turn would append after it)
            routes = self.sampler.routes(conv) if getattr(self.sampler, "record_routes", False) else None
        self.batches += 1
        self.calls += len(batch)
        return [(out.tokens[i, :out.count[i]].tolist(), out.logprobs[i, :out.count[i]].tolist(), bool(out.stopped[i]),
                 None if routes is None else routes[i, :len(r.prompt) + int(out.count[i])])
                for i, r in enumerate(batch)]
