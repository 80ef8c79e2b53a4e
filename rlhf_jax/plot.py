"""Learning curves of a run: ``python -m rlhf_jax.plot RUN_DIR [--out curve.png]``.

Reads ``RUN_DIR/metrics.jsonl`` (what the ``jsonl`` logger writes; ``RUN_DIR`` is the
run's ``trainer.default_local_dir``, or ``trainer.log_dir`` where that was set, or the
file itself) and draws one PNG with four panels against the step:
the training reward (``critic/score/mean``), the validation accuracy (each
``val-core/<data source>/reward/mean@<n>``: greedy when validation does not sample,
``actor_rollout_ref.rollout.val_kwargs``), the mean response length and the
policy's entropy. A panel whose metric the run did not log says so. When a
resumed run re-logged steps, the last record of each step wins. The PNG goes to
``--out`` (default ``RUN_DIR/curve.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PANELS = (
    ("reward (train, mean)", ("critic/score/mean",)),
    ("validation accuracy", ("val-core/",)),
    ("response length (mean tokens)", ("response_length/mean",)),
    ("entropy", ("actor/entropy",)),
)
FIGSIZE_IN, DPI = (10.0, 7.0), 100  # a 1000 x 700 pixel PNG


class PlotError(ValueError):
    """A run directory or metrics file that cannot be plotted (the message names it)."""


def metrics_path(run: str) -> str:
    path = run if os.path.isfile(run) else os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise PlotError(f"{run}: no metrics.jsonl (is this a run directory? trainer.logger must include 'jsonl')")
    return path


def read_metrics(path: str) -> dict[int, dict]:
    """Step -> metrics; a later record of the same step replaces the earlier one."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError) as e:
                raise PlotError(f"{path} line {line_no}: not a metrics record ({e})") from None
            by_step[step] = record
    if not by_step:
        raise PlotError(f"{path}: no metrics records")
    return by_step


def series(by_step: dict[int, dict], prefixes: tuple[str, ...]) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (steps, values) of every numeric metric whose name matches one of ``prefixes``
    (an exact name, or for names ending in '/' every metric under it that is a mean reward)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for step in sorted(by_step):
        for name, value in by_step[step].items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            wanted = any(name == p or (p.endswith("/") and name.startswith(p) and "/reward/mean@" in name)
                         for p in prefixes)
            if wanted:
                steps, values = out.setdefault(name, ([], []))
                steps.append(step)
                values.append(float(value))
    return out


def plot(run: str, out: str | None = None) -> str:
    """Write the PNG for ``run`` and return its path."""
    path = metrics_path(run)
    by_step = read_metrics(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install matplotlib") from None
    out = out or os.path.join(os.path.dirname(os.path.abspath(path)), "curve.png")
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE_IN, dpi=DPI)
    for ax, (title, prefixes) in zip(axes.flat, PANELS):
        lines = series(by_step, prefixes)
        for name, (steps, values) in sorted(lines.items()):
            label = name.split("/")[1] if name.startswith("val-core/") else None
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
        if not lines:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif any(name.startswith("val-core/") for name in lines):
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(path))) or path, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf_jax.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="run directory (trainer.default_local_dir, or trainer.log_dir if set) or a metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG to write (default RUN_DIR/curve.png)")
    args = p.parse_args(argv)
    try:
        print(plot(args.run, args.out))
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
