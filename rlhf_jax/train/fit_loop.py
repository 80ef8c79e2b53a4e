"""The run loop shared by every trainer (RL, SFT, DPO): the output directory's lock, resume, validation before
and during training, checkpoints and Hugging Face exports at their frequencies, and a stop request
(SIGTERM/SIGINT) that saves the last finished step and says how to resume.

A trainer is anything that offers the ``Trainer`` protocol; the loop owns the step counter, the logger, the
checkpoint service and the profiler, and hands each call what it needs.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Protocol

from ml_collections import ConfigDict

from rlhf_jax.parallel import groups
from rlhf_jax.runtime import run_lock
from rlhf_jax.runtime.storage_noise import quiet_storage_noise
from rlhf_jax.runtime.loggers import MetricLogger
from rlhf_jax.runtime.oom import out_of_memory_message
from rlhf_jax.runtime.oom import memory_hint
from rlhf_jax.runtime.preemption import StepAbandoned, StopRequest
from rlhf_jax.runtime.profiling import StepProfiler
from rlhf_jax.train.trainer_checkpoints import CheckpointItems, CheckpointService


class Trainer(Protocol):
    """What the run loop drives (and what ``main`` and the stage runner call: ``fit``, ``close``)."""

    loop: RunLoop  # the trainer's run: its step counter, logger and checkpoints

    def plan_memory(self) -> tuple[str, ...]:
        """Compile what a step runs before the first step (idempotent); returns the config keys that size its
        micro-batches (named by an out-of-memory message)."""

    def step(self, step: int) -> dict[str, Any]:
        """Training step ``step`` + 1 (``step`` updates done so far); its metrics. Raises ``StepAbandoned`` when a
        stop request arrived before the step changed any state (the data position is rewound)."""

    def validate(self, step: int) -> dict[str, float]:
        """Validation metrics after ``step`` steps (empty without validation data or on a stop request)."""

    def checkpoint_items(self, saved: dict | None = None) -> CheckpointItems:
        """What a checkpoint holds; with ``saved`` (a checkpoint's record), the restore targets of that one."""

    def restore(self, arrays: dict[str, Any], state: dict | None) -> None:
        """Take back a checkpoint's arrays, and its state record when the resume restores it (else None)."""

    def export_hf(self, step: int) -> str:
        """Write the policy as a Hugging Face directory for step ``step``; returns it."""

    def close(self) -> None:
        """Release what the trainer holds (threads, reward workers) and the run's services."""


def due(freq: int | None, step: int, is_last: bool) -> bool:
    """verl's rule for test_freq / save_freq: N > 0 every N steps and at the last step, <= 0 never;
    None (rlhf_jax's default) only at the last step."""
    if freq is None:
        return is_last
    return freq > 0 and (is_last or step % freq == 0)


class RunLoop:
    """One run's output directory and services: lock, logger, checkpoints, profiler, step counter."""

    def __init__(self, cfg: ConfigDict, stop: StopRequest, lock_dir: bool, *, checkpoint_contents: tuple,
                 max_to_keep: int | None):
        """``lock_dir``: refuse at once (before any model is loaded) when another run uses the output directory;
        ``fit`` always takes the lock. ``checkpoint_contents``: (actor save, actor load, critic save or None,
        critic load or None) contents."""
        t = cfg.trainer
        self.settings, self.stop = t, stop
        self.total_steps = int(cfg.derived.total_training_steps)
        self.hf_every_save = "hf_model" in checkpoint_contents[0]
        self.hint = memory_hint(cfg, "actor")
        self.is_main = groups.current().is_first
        self.out_dir = os.path.abspath(os.path.expanduser(t.default_local_dir))
        self.log_dir = os.path.abspath(os.path.expanduser(t.log_dir or self.out_dir))
        self._locks = 0
        if lock_dir:
            self._lock()
        self.step = 0
        self.size_keys: tuple[str, ...] = ()
        self.checkpoints = CheckpointService(os.path.join(self.out_dir, "checkpoints"), max_to_keep,
                                             *checkpoint_contents, steps_per_epoch=cfg.derived.steps_per_epoch,
                                             seed=int(t.seed), is_main=self.is_main)
        self.logger = MetricLogger(self.log_dir, t.logger, total_steps=self.total_steps, enabled=self.is_main,
                                   run=(t.project_name, t.experiment_name, cfg.to_dict()))
        self.profiler = StepProfiler(t.profile_steps, t.profile_dir)

    def _lock(self) -> None:
        run_lock.acquire(self.out_dir)
        self._locks += 1

    def resume(self, trainer: Trainer) -> None:
        """Restore the checkpoint ``trainer.resume_mode`` names into ``trainer`` (nothing when there is none)."""
        t = self.settings
        self.step = self.checkpoints.resume(trainer, t.resume_mode, t.resume_from_path, self.logger)

    def plan_memory(self, trainer: Trainer) -> None:
        self.size_keys = tuple(trainer.plan_memory())

    def out_of_memory(self, error: BaseException) -> str | None:
        """The one-line report of an out-of-memory ``error`` in a step (None for any other error)."""
        return out_of_memory_message(error, step=self.step, size_keys=self.size_keys, hint=self.hint,
                                     checkpoint_steps=self.checkpoints.complete_steps(),
                                     checkpoint_dir=self.checkpoints.directory)

    def fit(self, trainer: Trainer) -> dict[str, Any]:
        # A failed save's writer threads print their noise while training goes on (see quiet_storage_noise).
        with self.stop.installed(), quiet_storage_noise():
            return self._fit(trainer)

    def _timed_validation(self, trainer: Trainer, metrics: dict) -> None:
        start = time.perf_counter()
        val = trainer.validate(self.step)
        if val:
            metrics.update(val)
            metrics["timing_s/testing"] = time.perf_counter() - start

    def _save(self, trainer: Trainer, metrics: dict, is_last: bool) -> None:
        t = self.settings
        start = time.perf_counter()
        self.checkpoints.save(self.step, trainer.checkpoint_items())
        if t.save_hf_checkpoint == "always" or self.hf_every_save or (t.save_hf_checkpoint == "last" and is_last):
            metrics["hf_export_dir"] = trainer.export_hf(self.step)
        metrics["timing_s/save_checkpoint"] = time.perf_counter() - start

    def _fit(self, trainer: Trainer) -> dict[str, Any]:
        t = self.settings
        self._lock()
        self.resume(trainer)
        self.logger.open(self.step)  # after the resume: its step decides which logged records stay
        saved_step = self.step  # the step whose state is on disk (a resumed one, or none yet at step 0)
        if not t.val_only:
            self.plan_memory(trainer)
        last: dict[str, Any] = {}
        if t.val_only or (t.val_before_train and self.step == 0):  # as in verl, whatever test_freq says
            val: dict[str, Any] = {}
            self._timed_validation(trainer, val)
            if val:
                self.logger.log(self.step, val)
            if t.val_only:
                trainer.close()
                return val
        stopping = self.stop.agreed()
        saves = t.save_freq is None or t.save_freq > 0  # save_freq <= 0: no checkpoint at all, not even on a stop
        while self.step < self.total_steps and not stopping:
            try:
                with self.profiler.step(self.step + 1):
                    metrics = trainer.step(self.step)
            except StepAbandoned:
                stopping = True
                break
            self.step += 1
            self.checkpoints.check()  # an asynchronous save that failed (a full disk) stops the run now
            is_last = self.step == self.total_steps
            stopping = self.stop.agreed()
            if due(t.test_freq, self.step, is_last) and not stopping:
                self._timed_validation(trainer, metrics)
                stopping = self.stop.agreed()  # validation stops early on a signal
            if due(t.save_freq, self.step, is_last) or (stopping and saves):
                self._save(trainer, metrics, is_last)
                saved_step = self.step
            self.logger.log(self.step, metrics)
            last = metrics
        if stopping:
            if saved_step != self.step and saves:
                self.checkpoints.save(self.step, trainer.checkpoint_items())
            where = (f"checkpoint of step {self.step} in {self.checkpoints.directory}" if self.step and saves
                     else "trainer.save_freq <= 0, nothing saved" if self.step
                     else "no step had finished, nothing to save")
            if self.is_main:
                print(f"stopped by {self.stop.name} at step {self.step}/{self.total_steps}: {where}; "
                      "the same command resumes", file=sys.stderr, flush=True)
        trainer.close()
        return last

    def close(self) -> None:
        self.checkpoints.close()
        self.logger.close()
        for _ in range(self._locks):
            run_lock.release(self.out_dir)
        self._locks = 0
