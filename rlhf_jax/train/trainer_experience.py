"""The experience buffer: when the RL trainer samples, in rounds of ``experience.buffer_size`` batches, sequentially
or overlapped with training (see train/experience.py for the schedule and what a checkpoint keeps).

With ``experience.overlap`` the next round is sampled and scored in a worker thread, on the rollout devices
(``mesh.rollout_devices``) and the host, while the main thread trains on the training devices: JAX releases the
interpreter while its programs run, so both meshes and the reward functions work at once. The worker samples from
a copy of the weights taken before the update starts, and the step waits for it at its end, so a step boundary (a
checkpoint, a stop) never has sampling in flight.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable

from rlhf_jax.train import experience as X
from rlhf_jax.train import metrics as M
from rlhf_jax.runtime.preemption import StepAbandoned
from rlhf_jax.types import ScoredBatch

# produce(prompts, step, data_state, abandonable, weights, version) -> ScoredBatch
Produce = Callable[..., ScoredBatch]


class ExperienceBuffer:
    """Produced batches not yet trained on, oldest first, and the rounds that produce them."""

    def __init__(self, buffer_size: int, overlap: bool, total_steps: int, loader, produce: Produce):
        """``loader``: the prompt loader the rounds draw from; ``produce``: one prompt batch -> a ScoredBatch."""
        self.buffer_size, self.overlap, self.total_steps = int(buffer_size), bool(overlap), total_steps
        self.loader, self.produce = loader, produce
        self.pending: list[ScoredBatch] = []
        self._worker = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout")
                        if self.overlap else None)
        self.timeline: list[tuple[str, int, float, float]] = []  # (rollout | train, step, start, end): perf_counter

    def _produce_round(self, first: int, version: int, weights: Any, abandonable: bool) -> list[ScoredBatch]:
        """Sample and score the round of prompt batches for steps ``first``, ``first`` + 1, ... (0-based) with
        ``weights`` (version ``version``). A stop request (``abandonable``) drops the whole round and rewinds the
        loader: a resumed run samples it again, with the same weights, since no update happens in between."""
        count = min(self.buffer_size, self.total_steps - first)
        produced: list[ScoredBatch] = []
        start_state = self.loader.get_state()
        try:
            for i in range(count):
                state = self.loader.get_state()
                pb = next(self.loader)
                start = time.perf_counter()
                produced.append(self.produce(pb, first + i, state, abandonable, weights=weights, version=version))
                self.timeline.append(("rollout", first + i + 1, start, time.perf_counter()))
        except StepAbandoned:
            self.loader.set_state(start_state)
            raise
        return produced

    def train_next(self, step: int, weights: Callable[[], Any],
                   learn: Callable[[ScoredBatch, M.Timer], dict[str, Any]]) -> dict[str, Any]:
        """Step ``step`` (updates so far): ``learn`` on the oldest pending batch, producing rounds as they fall
        due with ``weights()`` (the sampler's current weights)."""
        timer = M.Timer()
        background = None
        with timer("step"):
            if not self.pending:  # the first round, or every round without overlap: sampled now
                self.pending.extend(self._produce_round(step, step, weights(), True))
            if self.overlap and X.production_due(len(self.pending), self.buffer_size, True) and \
                    step + len(self.pending) < self.total_steps:
                # The copy on the rollout devices is taken here, before the update replaces the actor's arrays.
                background = self._worker.submit(self._produce_round, step + len(self.pending), step, weights(),
                                                 False)
        try:
            start = time.perf_counter()
            metrics = learn(self.pending[0], timer)
            self.timeline.append(("train", step + 1, start, time.perf_counter()))
            self.pending.pop(0)
        finally:  # also when the step is abandoned: the round sampled meanwhile is kept, not lost
            if background is not None:
                with timer("step"), timer("wait_rollout"):
                    self.pending.extend(background.result())
        if background is not None:
            metrics["timing_s/step"] = timer.seconds["step"]
            metrics["timing_s/wait_rollout"] = timer.seconds["wait_rollout"]
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self) -> tuple[dict, list[dict], Any]:
        """(arrays, description, loader state before the first pending batch's prompts) of what is pending."""
        return X.checkpoint_pending(self.pending, self.loader)

    def restore(self, arrays: dict, described: list[dict]) -> None:
        """Take back the pending batches of a checkpoint; the loader already stands before their prompts."""
        self.pending = X.restore_pending(self.loader, arrays, described)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
