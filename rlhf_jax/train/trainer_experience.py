"""When the trainer samples: rounds of ``experience.buffer_size`` batches, sequentially or overlapped with training.

A mixin of ``Trainer`` (see train/experience.py for the schedule and what a checkpoint keeps). With
``experience.overlap`` the next round is sampled and scored in a worker thread, on the rollout devices
(``mesh.rollout_devices``) and the host, while the main thread trains on the training devices: JAX releases the
interpreter while its programs run, so both meshes and the reward functions work at once. The worker samples from
a copy of the weights taken before the update starts (``_rollout_weights``), and the step waits for it at its end,
so a step boundary (a checkpoint, a stop) never has sampling in flight.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from rlhf_jax.train import experience as X
from rlhf_jax.train import metrics as M
from rlhf_jax.runtime.preemption import StepAbandoned


class ExperienceMixin:
    def _init_experience(self) -> None:
        e = self.cfg.experience
        self.buffer_size, self.overlap = int(e.buffer_size), bool(e.overlap)
        self._pending: list[X.Experience] = []  # produced, not yet trained on; oldest first
        self._worker = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout")
                        if self.overlap else None)
        self.timeline: list[tuple[str, int, float, float]] = []  # (rollout | train, step, start, end): perf_counter

    def _produce_round(self, first: int, version: int, weights: Any, abandonable: bool) -> list[X.Experience]:
        """Sample and score the round of prompt batches for steps ``first``, ``first`` + 1, ... (0-based) with
        ``weights`` (version ``version``). A stop request (``abandonable``) drops the whole round and rewinds the
        loader: a resumed run samples it again, with the same weights, since no update happens in between."""
        count = min(self.buffer_size, self.total_steps - first)
        produced: list[X.Experience] = []
        start_state = self.loader.get_state()
        try:
            for i in range(count):
                state = self.loader.get_state()
                pb = next(self.loader)
                start = time.perf_counter()
                produced.append(self._produce(pb, first + i, state, abandonable, weights=weights, version=version))
                self.timeline.append(("rollout", first + i + 1, start, time.perf_counter()))
        except StepAbandoned:
            self.loader.set_state(start_state)
            raise
        return produced

    def _train_next(self) -> dict[str, Any]:
        """One training step on the oldest pending batch, producing rounds as they fall due."""
        timer = M.Timer()
        background = None
        with timer("step"):
            if not self._pending:  # the first round, or every round without overlap: sampled now
                self._pending.extend(self._produce_round(self.step, self.step, self._rollout_weights(), True))
            if self.overlap and X.production_due(len(self._pending), self.buffer_size, True) and \
                    self.step + len(self._pending) < self.total_steps:
                # The copy on the rollout devices is taken here, before the update replaces the actor's arrays.
                background = self._worker.submit(self._produce_round, self.step + len(self._pending), self.step,
                                                 self._rollout_weights(), False)
        try:
            start = time.perf_counter()
            metrics = self._learn(self._pending[0], timer)
            self.timeline.append(("train", self.step + 1, start, time.perf_counter()))
            self._pending.pop(0)
        finally:  # also when the step is abandoned: the round sampled meanwhile is kept, not lost
            if background is not None:
                with timer("step"), timer("wait_rollout"):
                    self._pending.extend(background.result())
        if background is not None:
            metrics["timing_s/step"] = timer.seconds["step"]
            metrics["timing_s/wait_rollout"] = timer.seconds["wait_rollout"]
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _pending_for_checkpoint(self) -> tuple[dict, list[dict], Any]:
        """(arrays, description, loader state before the first pending batch's prompts) of what is pending."""
        arrays, described = X.to_checkpoint(self._pending)
        state = self._pending[0].data_state if self._pending else self.loader.get_state()
        return arrays, described, state

    def _restore_pending(self, arrays: dict, described: list[dict]) -> None:
        """Take back the pending batches of a checkpoint; the loader already stands before their prompts."""
        pbs, states = [], []
        for _ in described:
            states.append(self.loader.get_state())
            pbs.append(next(self.loader))
        self._pending = X.from_checkpoint(arrays, described, pbs, states)

    def _close_experience(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
