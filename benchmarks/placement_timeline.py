"""Where and when the work runs: colocated, split and overlapped layouts of the default GRPO recipe.

Runs the default recipe (built-in tiny model, synthetic arithmetic) on 8 fake CPU devices in three layouts:

- colocated: every device samples and trains, one after the other (the default);
- split: 4 devices sample, the other 4 train, one after the other (``mesh.rollout_devices=4``);
- overlap: the same split, sampling the next batch while the current one trains (``experience.overlap=True``,
  one-step off-policy).

For each it prints the median step time over the steps after the first (which compiles) and a text timeline of
the last steps: when the rollout devices were sampling and scoring, and when the training devices were training.

    python benchmarks/placement_timeline.py                        # 12 steps, 16 new tokens
    python benchmarks/placement_timeline.py --steps 4 --json ''    # smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LAYOUTS = {
    "colocated": {},
    "split": {"mesh.rollout_devices": 4},
    "overlap": {"mesh.rollout_devices": 4, "experience.overlap": True},
}


def _config(out_dir: str, steps: int, new_tokens: int, overrides: dict):
    import importlib.util

    spec = importlib.util.spec_from_file_location("grpo_recipe", os.path.join(REPO, "configs", "grpo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    settings = {"trainer.total_training_steps": steps, "trainer.default_local_dir": out_dir, "trainer.test_freq": 0,
                "trainer.val_before_train": False, "trainer.save_freq": 0, "trainer.save_hf_checkpoint": "never",
                "trainer.logger": ("jsonl",), "data.max_response_length": new_tokens,
                "actor_rollout_ref.rollout.ignore_eos": True, **overrides}
    for path, value in settings.items():
        node = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def _timeline_text(timeline: list, first_step: int, width: int = 100) -> list[str]:
    """Two rows of characters from the start of training step ``first_step``: where the rollout devices sampled
    and scored, and where the training devices trained (each mark is the step the batch is for, mod 10)."""
    starts = [a for kind, step, a, _ in timeline if kind == "train" and step >= first_step]
    if not starts:
        return []
    t0 = min(starts)  # from the first shown training step; sampling that began earlier is cut at t0
    spans = [(kind, step, max(a, t0), b) for kind, step, a, b in timeline if b > t0]
    t1 = max(b for _, _, _, b in spans)
    scale = width / max(t1 - t0, 1e-9)
    rows = {"rollout": [" "] * width, "train": [" "] * width}
    for kind, step, a, b in spans:
        lo, hi = int((a - t0) * scale), max(int((a - t0) * scale) + 1, int((b - t0) * scale))
        for i in range(lo, min(hi, width)):
            rows[kind][i] = str(step % 10)
    return [f"  sampling |{''.join(rows['rollout'])}| {t1 - t0:.2f} s",
            f"  training |{''.join(rows['train'])}|"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "placement_timeline.json"))
    args = parser.parse_args()

    import jax

    from rlhf_jax.train.trainer import Trainer

    print(f"{jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} CPU cores; "
          f"{args.steps} steps, {args.new_tokens} new tokens (ignore_eos)")
    results = {}
    for name, overrides in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as out_dir:
            trainer = Trainer(_config(out_dir, args.steps, args.new_tokens, overrides))
            trainer.fit()
            with open(os.path.join(out_dir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
        steps = [r["timing_s/step"] for r in rows[1:]]
        timeline = trainer.experience.timeline
        busy = {kind: sum(b - a for k, s, a, b in timeline if k == kind and s > 1) for kind in ("rollout", "train")}
        results[name] = {"median_step_s": statistics.median(steps), "steps_s": steps,
                         "rollout_busy_s": busy["rollout"], "train_busy_s": busy["train"],
                         "score_last": rows[-1]["critic/score/mean"]}
        print(f"\n{name}: median step {results[name]['median_step_s'] * 1000:.1f} ms "
              f"(sampling+scoring {busy['rollout']:.2f} s, training {busy['train']:.2f} s over steps 2-{args.steps})")
        for line in _timeline_text(trainer.experience.timeline, first_step=max(2, args.steps - 3)):
            print(line)
    base = results["colocated"]["median_step_s"]
    print("\nstep time relative to colocated: " + ", ".join(
        f"{k} {v['median_step_s'] / base:.2f}x" for k, v in results.items()))
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "new_tokens": args.new_tokens, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
