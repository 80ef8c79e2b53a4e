"""Metric sinks: a compact console line (plus a progress bar), metrics.jsonl, tensorboard event files.

``trainer.logger`` picks any of ``console``, ``jsonl``, ``tensorboard``. Only
process 0 writes. Files live under ``trainer.default_local_dir``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Iterable

LOGGERS = ("console", "jsonl", "tensorboard")
# The metrics the console line shows, in order (when present).
CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("val-core", "val"),
    ("actor/pg_loss", "pg"),
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
    def __init__(self, log_dir: str, backends: Iterable[str], *, total_steps: int, enabled: bool = True):
        backends = tuple(backends)
        unknown = [b for b in backends if b not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; choose from {LOGGERS}")
        self.enabled = enabled
        self.backends = backends
        self.total_steps = total_steps
        self.start = time.time()
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        if "jsonl" in backends:
            self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a", buffering=1)
        if "tensorboard" in backends:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(log_dir, "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        metrics = {k: _clean(v) for k, v in sorted(metrics.items())}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
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


def progress_bar(step: int, total: int, elapsed: float, width: int = 20) -> str:
    total = max(total, 1)
    frac = min(step / total, 1.0)
    filled = int(round(frac * width))
    eta = elapsed / max(step, 1) * (total - step) if step else float("nan")
    eta_s = f"{eta:5.0f}s" if math.isfinite(eta) else "   ?s"
    return f"[{'#' * filled}{'.' * (width - filled)}] {step}/{total} eta {eta_s}"


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
