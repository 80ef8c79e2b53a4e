"""The run loop shared by every trainer (RL, SFT, DPO): the output directory's lock, resume, validation before
and during training, checkpoints and Hugging Face exports at their frequencies, and a stop request
(SIGTERM/SIGINT) that saves the last finished step and says how to resume.

A trainer mixes in ``FitLoop`` next to ``CheckpointMixin`` and provides ``cfg``, ``stop``, ``step``,
``total_steps``, ``logger``, ``checkpointer``, ``profiler`` and:

- ``_next_step() -> metrics``: one training step; raises ``StepAbandoned`` when a stop request arrived before
  the step changed the weights (the trainer has rewound its loader so a resumed run samples the same data);
- ``validate() -> metrics``;
- ``plan_memory()``: runs once before the first step (not in validation-only runs, which compile no training
  program);
- ``_close_resources()``: what the trainer holds beyond the checkpointer, the logger and the lock.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import jax

from rlhf_jax.runtime import run_lock
from rlhf_jax.runtime.checkpoint import quiet_storage_noise
from rlhf_jax.runtime.preemption import StepAbandoned


def due(freq: int | None, step: int, is_last: bool) -> bool:
    """verl's rule for test_freq / save_freq: N > 0 every N steps and at the last step, <= 0 never;
    None (rlhf_jax's default) only at the last step."""
    if freq is None:
        return is_last
    return freq > 0 and (is_last or step % freq == 0)


class FitLoop:
    def _open_output(self, lock_dir: bool) -> None:
        """Output and log directories; ``lock_dir`` refuses at once (before any model is loaded) when another run
        uses the output directory. ``fit`` always takes the lock."""
        t = self.cfg.trainer
        self.is_main = jax.process_index() == 0
        self.out_dir = os.path.abspath(os.path.expanduser(t.default_local_dir))
        self.log_dir = os.path.abspath(os.path.expanduser(t.log_dir or self.out_dir))
        self._locks = 0
        if lock_dir:
            self._lock()

    def _lock(self) -> None:
        run_lock.acquire(self.out_dir)
        self._locks += 1

    def fit(self) -> dict[str, Any]:
        # A failed save's writer threads print their noise while training goes on (see quiet_storage_noise).
        with self.stop.installed(), quiet_storage_noise():
            return self._fit()

    def _timed_validation(self, metrics: dict) -> None:
        start = time.perf_counter()
        val = self.validate()
        if val:
            metrics.update(val)
            metrics["timing_s/testing"] = time.perf_counter() - start

    def _fit(self) -> dict[str, Any]:
        t = self.cfg.trainer
        self._lock()
        self.maybe_resume()
        self.logger.open(self.step)  # after the resume: its step decides which logged records stay
        saved_step = self.step  # the step whose state is on disk (a resumed one, or none yet at step 0)
        if not t.val_only:
            self.plan_memory()
        last: dict[str, Any] = {}
        if t.val_only or (t.val_before_train and self.step == 0):  # as in verl, whatever test_freq says
            val: dict[str, Any] = {}
            self._timed_validation(val)
            if val:
                self.logger.log(self.step, val)
            if t.val_only:
                self.close()
                return val
        stopping = self.stop.agreed()
        saves = t.save_freq is None or t.save_freq > 0  # save_freq <= 0: no checkpoint at all, not even on a stop
        while self.step < self.total_steps and not stopping:
            try:
                with self.profiler.step(self.step + 1):
                    metrics = self._next_step()
            except StepAbandoned:
                stopping = True
                break
            self.step += 1
            self.checkpointer.check()  # an asynchronous save that failed (a full disk) stops the run now
            is_last = self.step == self.total_steps
            stopping = self.stop.agreed()
            if due(t.test_freq, self.step, is_last) and not stopping:
                self._timed_validation(metrics)
                stopping = self.stop.agreed()  # validation stops early on a signal
            if due(t.save_freq, self.step, is_last) or (stopping and saves):
                start = time.perf_counter()
                self.save_checkpoint()
                saved_step = self.step
                contents = self.cfg.actor_rollout_ref.actor.checkpoint.save_contents
                if t.save_hf_checkpoint == "always" or "hf_model" in contents or (
                        t.save_hf_checkpoint == "last" and is_last):
                    metrics["hf_export_dir"] = self.export_hf()
                metrics["timing_s/save_checkpoint"] = time.perf_counter() - start
            self.logger.log(self.step, metrics)
            last = metrics
        if stopping:
            if saved_step != self.step and saves:
                self.save_checkpoint()
            where = (f"checkpoint of step {self.step} in {self.checkpointer.directory}" if self.step and saves
                     else "trainer.save_freq <= 0, nothing saved" if self.step
                     else "no step had finished, nothing to save")
            if self.is_main:
                print(f"stopped by {self.stop.name} at step {self.step}/{self.total_steps}: {where}; "
                      "the same command resumes", file=sys.stderr, flush=True)
        self.close()
        return last

    def _close_resources(self) -> None:
        """What a trainer holds beyond the checkpointer, the logger and the directory lock."""

    def close(self) -> None:
        self._close_resources()
        self.checkpointer.close()
        self.logger.close()
        for _ in range(self._locks):
            run_lock.release(self.out_dir)
        self._locks = 0
