"""Multi-stage runs (``stages``): e.g. an SFT warm-up, then GRPO from its weights, as one command.

Each entry of ``stages`` is a mapping of overrides of the shared config (dotted keys or nested sections, like a
verl YAML) plus ``stage_name``; its ``algorithm.type`` picks its trainer (train/tasks.py), so a stage has its own
algorithm, data and step count. Stage ``i`` keeps checkpoints, logs and exports in
``<trainer.default_local_dir>/stage_<i>_<name>`` and, once it has run all its steps, exports its weights (the
last step's HF directory) and writes ``stage_done.json`` there. The next stage starts from that export. Rerunning
the command skips finished stages and resumes the unfinished one from its latest checkpoint, so a run stopped
by SIGTERM in stage 2 continues in stage 2 at its step (``trainer.resume_mode=disable`` starts over).

Every stage's config is checked (``finalize``) before any model loads; errors name ``stages[i].<key>``. A
command-line override of a key a stage sets is refused in favour of ``--config.stages.<i>.<key>=<value>``
(config/stage_overrides.py).
"""

from __future__ import annotations

import copy
import gc
import json
import os
from typing import Any

from ml_collections import ConfigDict

from rlhf_jax.parallel import groups
from rlhf_jax.config import finalize, schema
from rlhf_jax.config.interpolation import has_reference, resolve
from rlhf_jax.config.stage_overrides import NAME, flatten_stage
from rlhf_jax.config.yaml_import import coerce
from rlhf_jax.train import tasks
from rlhf_jax.runtime import run_lock
from rlhf_jax.runtime.preemption import STOP, StopRequest

DONE = "stage_done.json"
MODEL_PATH = "actor_rollout_ref.model.path"


class StageSetupError(ValueError):
    """A later stage cannot be built (its data, its model); names the stage."""


def _resolved(cfg: ConfigDict, path: str) -> Any:
    """The value of ``path`` with its ``${...}`` references resolved against ``cfg``."""
    value = schema.get_path(cfg, path)
    lookup = lambda p: schema.get_path(cfg, p)  # noqa: E731
    while has_reference(value):
        value = resolve(value, lookup, path)
    return value


def stage_configs(cfg: ConfigDict) -> list[tuple[str, str, ConfigDict]]:
    """(name, directory, config) of every stage; each config is finalized once here, so a bad stage stops the
    run before anything loads, naming ``stages[i].<key>``."""
    base = ConfigDict(cfg.to_dict())
    base.unlock()
    stages = tuple(base.stages)
    base.stages = ()
    if cfg.trainer.resume_mode == "resume_path":
        raise ValueError("trainer.resume_mode=resume_path names one checkpoint; a run with stages resumes each stage "
                         "from its own directory: use auto (or disable)")
    run_dir = os.path.abspath(os.path.expanduser(_resolved(base, "trainer.default_local_dir")))
    log_root = os.path.abspath(os.path.expanduser(_resolved(base, "trainer.log_dir") or run_dir))
    out, names = [], set()
    for i, stage in enumerate(stages):
        where = f"stages[{i}]"
        if not isinstance(stage, dict):
            raise ValueError(f"{where} must be a mapping of config overrides with a stage_name, got "
                             f"{type(stage).__name__}")
        stage = dict(stage)
        name = str(stage.pop(NAME, f"stage{i}"))
        if not name or name in names or "/" in name:
            raise ValueError(f"{where}.{NAME}={name!r} must be a unique name without '/'")
        names.add(name)
        overrides = flatten_stage(stage, where)
        if "stages" in overrides:
            raise ValueError(f"{where}.stages: a stage cannot hold stages")
        if i > 0 and MODEL_PATH in overrides:
            raise ValueError(f"{where}.{MODEL_PATH}: a stage after the first starts from the previous stage's "
                             "weights; set the model in the first stage or the shared config")
        if "algorithm.type" in overrides:
            tasks.check_type(overrides["algorithm.type"], key=f"{where}.algorithm.type")
        c = copy.deepcopy(base)
        for path, value in overrides.items():
            key = schema.get_key(path)
            try:
                schema.set_path(c, path, None if value is None else coerce(key, value))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}.{path}: {e}") from None
        sub = f"stage_{i}_{name}"
        c.trainer.default_local_dir = os.path.join(run_dir, sub)
        c.trainer.log_dir = os.path.join(log_root, sub)
        c.trainer.experiment_name = f"{_resolved(base, 'trainer.experiment_name')}_{name}"
        try:
            finalize(c, num_devices=groups.device_count(), num_processes=groups.process_count())
        except (KeyError, ValueError, FileNotFoundError) as e:
            raise ValueError(f"{where} ({name}): {e}") from None
        out.append((name, c.trainer.default_local_dir, c))
    if not out:
        raise ValueError("stages is empty")
    return out


def finished(directory: str) -> dict | None:
    """The done record of a stage directory (its final weights), or None while it has not finished."""
    path = os.path.join(directory, DONE)
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


class StageRunner:
    """Runs the stages in order; ``main`` builds it like a trainer (``cls(cfg, lock_dir=True)``)."""

    def __init__(self, cfg: ConfigDict, stop: StopRequest = STOP, lock_dir: bool = False):
        self.stop = stop
        self.stages = stage_configs(cfg)
        self.run_dir = os.path.dirname(self.stages[0][1])
        self.fresh = cfg.trainer.resume_mode == "disable"
        self._locked = False
        if lock_dir:
            run_lock.acquire(self.run_dir)
            self._locked = True
        self.is_main = groups.current().is_first
        self.index, self.weights = self._first_unfinished()
        self.trainer = self._build(self.index) if self.index < len(self.stages) else None

    def _first_unfinished(self) -> tuple[int, str | None]:
        weights = None
        for i, (_, directory, _) in enumerate(self.stages):
            record = None if self.fresh else finished(directory)
            if record is None:
                return i, weights
            weights = record["weights"]
        return len(self.stages), weights

    def _build(self, i: int):
        name, _, cfg = self.stages[i]
        cfg = ConfigDict(cfg.to_dict())
        if self.weights is not None:
            schema.set_path(cfg, MODEL_PATH, self.weights)
            # the export holds the previous stage's tokenizer (and its chat template)
        if self.fresh:
            cfg.trainer.resume_mode = "disable"
        if self.is_main:
            print(f"stage {i + 1}/{len(self.stages)}: {name} ({cfg.algorithm.type})"
                  + (f", from {self.weights}" if self.weights else ""), flush=True)
        return tasks.trainer_class(cfg.algorithm.type)(cfg, lock_dir=True)

    def plan_memory(self) -> None:
        if self.trainer is not None:
            self.trainer.plan_memory()

    def out_of_memory(self, error: BaseException) -> str | None:
        return self.trainer.out_of_memory(error) if self.trainer is not None else None

    def fit(self) -> dict[str, Any]:
        last: dict[str, Any] = {}
        if self.trainer is None and self.is_main:
            print(f"every stage has finished (stage_done.json in each stage directory of {self.run_dir}); "
                  "trainer.resume_mode=disable runs them again", flush=True)
        while self.trainer is not None:
            trainer, (name, directory, _) = self.trainer, self.stages[self.index]
            last = trainer.fit()
            step = trainer.loop.step
            if step < trainer.loop.total_steps or self.stop.agreed():
                break  # stopped by a signal: the stage resumes from its checkpoint on the next run
            export = os.path.join(directory, "hf", f"global_step_{step}")
            if not os.path.exists(os.path.join(export, "config.json")):
                export = trainer.export_hf(step)
            if self.is_main:
                with open(os.path.join(directory, DONE + ".tmp"), "w") as fh:
                    json.dump({"stage": name, "step": step, "weights": export}, fh)
                os.replace(os.path.join(directory, DONE + ".tmp"), os.path.join(directory, DONE))
            self.trainer = None
            del trainer
            gc.collect()  # the finished stage's arrays go before the next stage loads its models
            self.index, self.weights = self.index + 1, export
            if self.index < len(self.stages):
                try:
                    self.trainer = self._build(self.index)
                except (KeyError, ValueError, FileNotFoundError) as e:
                    raise StageSetupError(f"stage {self.stages[self.index][0]}: {e}") from None
                self.trainer.plan_memory()
        self.close()
        return last

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        if self._locked:
            run_lock.release(self.run_dir)
            self._locked = False
