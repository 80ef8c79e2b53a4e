"""Metric sinks: a compact console line (plus a progress bar), metrics.jsonl, tensorboard event files.

``trainer.logger`` picks any of ``console``, ``jsonl``, ``tensorboard``, and the
optional trackers ``wandb`` and ``mlflow`` (:mod:`rlhf_jax.runtime.trackers`). Only
process 0 writes. Files live in ``trainer.log_dir`` (by default the run's
``trainer.default_local_dir``, next to its checkpoints).

A directory's files belong to one run: :meth:`MetricLogger.open` is called with
the step the run starts from. A fresh run (step 0) moves files left by an earlier
run aside (``metrics.jsonl`` -> ``metrics.jsonl.1``); a resumed run keeps the
records up to its checkpoint's step and drops those of the steps it re-runs.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Iterable

from rlhf_jax.parallel import groups
from rlhf_jax.config.names import LOGGERS

VAL_GENERATIONS = "val_generations.jsonl"
# The metrics the console line shows, in order (when present).
CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("train/loss", "loss"),
    ("val/loss", "val_loss"),
    ("val-core", "val"),
    ("actor/pg_loss", "pg"),
    ("actor/dpo_loss", "dpo"),
    ("rewards/accuracies", "acc"),
    ("val/rewards/accuracies", "acc@val"),
    ("actor/kl_loss", "kl"),
    ("actor/entropy", "ent"),
    ("critic/vf_loss", "vf"),
    ("actor/grad_norm", "gnorm"),
    ("response_length/mean", "len"),
    ("timing_s/step", "s/step"),
    ("perf/throughput", "tok/s"),
)


def _clean(value: Any) -> Any:
    value = float(value) if hasattr(value, "__float__") else value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricLogger:
    """``run`` (project, experiment, config: a dict) names the run for the trackers (wandb, mlflow)."""

    def __init__(self, log_dir: str, backends: Iterable[str], *, total_steps: int, enabled: bool = True,
                 run: tuple[str, str, dict] = ("rlhf_jax", "default", {})):
        backends = tuple(backends)
        unknown = [b for b in backends if b not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; choose from {LOGGERS}")
        self.enabled = enabled
        self.backends = backends
        self.total_steps = total_steps
        self.start = time.time()
        self.log_dir = log_dir
        self._jsonl = None
        self._tb = None
        self._trackers: list = []
        self.run = run
        self._start_step: int | None = None

    def open(self, step: int) -> None:
        """Open the sinks for a run that starts at ``step`` (0: fresh, else resumed from that checkpoint)."""
        self._start_step = step
        if not self.enabled:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        if "jsonl" in self.backends:
            path = own_file(os.path.join(self.log_dir, "metrics.jsonl"), step)
            self._jsonl = open(path, "a", buffering=1)
        own_file(os.path.join(self.log_dir, VAL_GENERATIONS), step)
        if "tensorboard" in self.backends:
            from tensorboardX import SummaryWriter

            tb_dir = os.path.join(self.log_dir, "tensorboard")
            if step == 0:
                _move_aside(tb_dir)
            # purge_step: TensorBoard drops the earlier events of the steps this run logs again.
            self._tb = SummaryWriter(tb_dir, purge_step=step + 1 if step else None)
        from rlhf_jax.runtime.trackers import TRACKERS

        self._trackers = [TRACKERS[b](self.log_dir, *self.run) for b in self.backends if b in TRACKERS]

    def val_generations(self, step: int, examples: list[dict]) -> None:
        """Append one validation's examples (prompt, response, score, ground truth) to val_generations.jsonl."""
        if not self.enabled:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, VAL_GENERATIONS), "a") as f:
            f.write(json.dumps({"step": step, "examples": examples}, ensure_ascii=False) + "\n")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._start_step is None:
            self.open(0)
        metrics = {k: _clean(v) for k, v in sorted(metrics.items())}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        for tracker in self._trackers:
            tracker.log(step, metrics)
        if "console" in self.backends:
            print(self.console_line(step, metrics), flush=True)

    def console_line(self, step: int, metrics: dict[str, Any]) -> str:
        parts = []
        for key, short in CONSOLE_KEYS:
            if key == "val-core":
                for k, v in metrics.items():
                    if k.startswith("val-core/") and isinstance(v, float):
                        parts.append(f"{k.split('/', 2)[1]}@val={v:.3f}")
                continue
            if key in metrics and isinstance(metrics[key], (int, float)):
                parts.append(f"{short}={metrics[key]:.4g}")
        return f"{progress_bar(step, self.total_steps, time.time() - self.start)} step {step} | " + " ".join(parts)

    def text(self, message: str) -> None:
        if self.enabled and "console" in self.backends:
            print(message, flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


def dump_generations(directory: str, step: int, inputs: list[str], outputs: list[str], gts: list, scores,
                     weight_version: int | None = None) -> str:
    """verl's rollout / validation dump: ``<directory>/<step>.jsonl``, one line per response (process p of
    several writes ``<step>.p<p>.jsonl``: each holds its own prompts). ``weight_version``: the updates applied to
    the weights that sampled a training rollout (``step`` - 1 when sampled on-policy)."""
    os.makedirs(directory, exist_ok=True)
    name = f"{step}.jsonl" if groups.process_count() == 1 else f"{step}.p{groups.process_index()}.jsonl"
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        for i, o, g, s in zip(inputs, outputs, gts, scores):
            row = {"input": i, "output": o, "gts": g if isinstance(g, (str, int, float)) else str(g),
                   "score": float(s), "step": step}
            if weight_version is not None:
                row["weight_version"] = weight_version
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def _move_aside(path: str) -> str | None:
    """Rename ``path`` (a file or directory left by an earlier run) to ``path.N``, the first free N."""
    if not os.path.exists(path):
        return None
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    os.replace(path, f"{path}.{n}")
    print(f"{path} belongs to an earlier run: moved to {path}.{n}", file=sys.stderr, flush=True)
    return f"{path}.{n}"


def own_file(path: str, step: int) -> str:
    """Make the jsonl file ``path`` this run's: moved aside for a fresh run (step 0), cut to the records of
    steps <= ``step`` for a run resumed at ``step`` (the steps after it run again and are logged again)."""
    if step == 0:
        _move_aside(path)
        return path
    if not os.path.exists(path):
        return path
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)  # atomic: a crash here leaves the old file or the new one
    return path


def progress_bar(step: int, total: int, elapsed: float, width: int = 20) -> str:
    total = max(total, 1)
    frac = min(step / total, 1.0)
    filled = int(round(frac * width))
    eta = elapsed / max(step, 1) * (total - step) if step else float("nan")
    eta_s = f"{eta:5.0f}s" if math.isfinite(eta) else "   ?s"
    return f"[{'#' * filled}{'.' * (width - filled)}] {step}/{total} eta {eta_s}"


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
