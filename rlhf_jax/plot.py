"""Learning curves of runs: ``python -m rlhf_jax.plot RUN_DIR [RUN_DIR ...] [--out curve.png]``.

Reads each ``RUN_DIR/metrics.jsonl`` (what the ``jsonl`` logger writes; ``RUN_DIR`` is the
run's ``trainer.default_local_dir``, or ``trainer.log_dir`` where that was set, or the
file itself) and draws one PNG with four panels against the step:
the training reward (``critic/score/mean``), the validation accuracy (each
``val-core/<data source>/reward/mean@<n>``: greedy when validation does not sample,
``actor_rollout_ref.rollout.val_kwargs``), the mean response length and the
policy's entropy. A panel whose metric the run did not log says so. When a
resumed run re-logged steps, the last record of each step wins. The PNG goes to
``--out`` (default ``RUN_DIR/curve.png``).

Several runs of one recipe (other seeds, other machines) share one picture: each
panel draws one thin line per run, named by its directory, and their mean as a
thick black line at the steps every run logged. The default output is then
``curves.png`` in the runs' common parent directory.
"""

from __future__ import annotations

import argparse
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Line:
    label: str | None
    steps: list[int]
    values: list[float]
    is_mean: bool = False


def run_label(path: str) -> str:
    """A run's name in legends: its directory's name (the metrics file's directory)."""
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or path


def mean_line(per_run: list[tuple[list[int], list[float]]]) -> tuple[list[int], list[float]]:
    """The mean over runs at the steps every run logged."""
    common = sorted(set.intersection(*(set(steps) for steps, _ in per_run)))
    lookups = [dict(zip(steps, values)) for steps, values in per_run]
    return common, [sum(look[s] for look in lookups) / len(lookups) for s in common]


def data_source(name: str) -> str | None:
    """``gsm8k`` for ``val-core/gsm8k/reward/mean@1``: what tells validation sets apart in a legend."""
    return name.split("/")[1] if name.startswith("val-core/") else None


def panel_lines(runs: list[tuple[str, dict[int, dict]]], prefixes: tuple[str, ...]) -> list[Line]:
    """The lines of one panel: one run's metrics by name, or for several runs one line per run and metric name
    plus each name's mean over the runs that logged it."""
    found = [(label, series(by_step, prefixes)) for label, by_step in runs]
    names = sorted({name for _, lines in found for name in lines})
    if len(runs) == 1:
        return [Line(data_source(name), *found[0][1][name]) for name in names]
    out = []
    several = len(names) > 1
    for name in names:
        per_run = [(label, lines[name]) for label, lines in found if name in lines]
        suffix = f" {data_source(name)}" if several and data_source(name) else ""
        out += [Line(label + suffix, steps, values) for label, (steps, values) in per_run]
        if len(per_run) > 1:
            out.append(Line(f"mean of {len(per_run)}{suffix}", *mean_line([sv for _, sv in per_run]), is_mean=True))
    return out


def default_out(paths: list[str]) -> str:
    dirs = [os.path.dirname(os.path.abspath(p)) for p in paths]
    if len(dirs) == 1:
        return os.path.join(dirs[0], "curve.png")
    return os.path.join(os.path.commonpath(dirs), "curves.png")


def plot(runs: str | list[str], out: str | None = None) -> str:
    """Write the PNG for one run or several (one line each plus their mean) and return its path."""
    paths = [metrics_path(run) for run in ([runs] if isinstance(runs, str) else runs)]
    loaded = [(run_label(path), read_metrics(path)) for path in paths]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install matplotlib") from None
    out = out or default_out(paths)
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE_IN, dpi=DPI)
    for ax, (title, prefixes) in zip(axes.flat, PANELS):
        lines = panel_lines(loaded, prefixes)
        for line in lines:
            marker = "o" if len(line.steps) < 30 else None
            style = dict(color="black", linewidth=2.5, zorder=3) if line.is_mean else \
                dict(linewidth=1.0 if len(loaded) > 1 else 1.5, alpha=0.6 if len(loaded) > 1 else 1.0)
            ax.plot(line.steps, line.values, marker=marker, markersize=3, label=line.label, **style)
        if not lines:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif any(line.label for line in lines):
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(", ".join(label for label, _ in loaded) if len(loaded) < 4
                 else f"{len(loaded)} runs: {loaded[0][0]}, ...", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf_jax.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="run directory (trainer.default_local_dir, or trainer.log_dir if set) or a metrics.jsonl; "
                        "several runs are drawn together with their mean")
    p.add_argument("--out", default=None,
                   help="PNG to write (default RUN_DIR/curve.png; for several runs curves.png in their common parent)")
    args = p.parse_args(argv)
    try:
        print(plot(args.runs, args.out))
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
