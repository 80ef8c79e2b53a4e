"""Sampling on processes of their own (``mesh.rollout_processes``) against the layouts a user would pick instead.

The default GRPO recipe (built-in tiny model, synthetic arithmetic) with long responses (``ignore_eos``) on few
rows, so the sampler is slower than the trainer, in five layouts on the same 8 fake CPU devices:

- colocated: one process, every device samples then trains;
- overlap: one process, 4 devices sample the next batch while 4 train (``mesh.rollout_devices=4`` +
  ``experience.overlap``);
- split: 4 processes x 2 devices over gloo, 2 sampling and 2 training (``mesh.rollout_processes=2``), weights
  and batches device to device (``jax.experimental.transfer``);
- split + LoRA: the same, rank 8: only the adapters move;
- split + partial: the same with ``experience.partial_rollout_tokens`` = a quarter of the response.

For each: the median step time over the steps after the first two (which compile), the training side's wait for
the batch, the sampling side's generation time, the weights moved per step and the sampling side's time taking
them in, and the fraction of the sampling time hidden behind training (1 - wait / (generation + scoring)). The
machine's matmul FLOP/s and host copy bandwidth are measured in the same run (the floor of a weight transfer is
its bytes over the copy bandwidth).

    chrt -f 1 python benchmarks/split_run.py                 # 8 steps, 8 prompts x 2, 384 new tokens
    python benchmarks/split_run.py --steps 4 --json ''       # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_MESH = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 1}
LORA = {"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.lora_alpha": 16.0}
SPLIT = {**TRAIN_MESH, "mesh.rollout_processes": 2, "experience.overlap": True}


def layouts(new_tokens: int) -> dict[str, tuple[int, dict]]:
    """name -> (processes, overrides); every layout has 8 devices in all."""
    return {
        "colocated": (1, {}),
        "overlap": (1, {**TRAIN_MESH, "mesh.rollout_devices": 4, "experience.overlap": True}),
        "split": (4, SPLIT),
        "split + LoRA": (4, {**SPLIT, **LORA}),
        "split + partial": (4, {**SPLIT, "experience.partial_rollout_tokens": max(new_tokens // 4, 1)}),
    }


def _args(out_dir: str, a: argparse.Namespace, overrides: dict) -> list[str]:
    settings = {"trainer.total_training_steps": a.steps, "trainer.default_local_dir": out_dir, "trainer.test_freq": 0,
                "trainer.val_before_train": False, "trainer.save_freq": 0, "trainer.save_hf_checkpoint": "never",
                "trainer.logger": "('jsonl',)", "data.max_response_length": a.new_tokens,
                "data.train_batch_size": a.prompts, "actor_rollout_ref.actor.ppo_mini_batch_size": a.prompts,
                "actor_rollout_ref.rollout.n": a.samples, "actor_rollout_ref.rollout.ignore_eos": True, **overrides}
    return [f"--config={os.path.join(REPO, 'configs', 'grpo.py')}", *(f"--config.{k}={v}" for k, v in settings.items())]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(processes: int, args: list[str]) -> float:
    """Run one layout to its end; its wall time in seconds."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if processes == 1:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        cmd = [sys.executable, "-m", "rlhf_jax.main", *args]
    else:
        env.update(RLHF_JAX_PORT=str(_free_port()),
                   PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
        cmd = ["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), str(processes), str(8 // processes), *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def summary(rows: list[dict]) -> dict:
    """Medians over the steps after the first two (both compile: the second batch is the first with new weights)
    but the last (it has no next batch to wait for or send weights to). Sampling is hidden only where it overlaps
    training (a colocated step contains it)."""
    timed = rows[2:-1] or rows[-1:]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in timed)  # noqa: E731
    sampling = med("timing_s/gen") + med("timing_s/reward")
    overlaps = "timing_s/wait_rollout" in timed[0]
    return {"step_s": med("timing_s/step"), "wait_rollout_s": med("timing_s/wait_rollout"), "gen_s": med("timing_s/gen"),
            "sampling_s": sampling, "update_s": med("timing_s/update_actor"),
            "weight_bytes_sent": med("split/weight_bytes_sent"), "weight_receive_s": med("split/weight_receive_s"),
            "hidden": 1.0 - med("timing_s/wait_rollout") / sampling if sampling and overlaps else 0.0,
            "partial_fraction": med("rollout/partial_fraction"), "score_last": rows[-1]["critic/score/mean"]}


def roofline() -> dict:
    """This machine's matmul FLOP/s (float32, 2048^2, best of 5) and host copy bandwidth (256 MiB, best of 5)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    src, best_mm, best_copy = np.ones(64 << 20, np.float32), float("inf"), float("inf")
    dst = np.empty_like(src)
    for _ in range(5):
        start = time.perf_counter()
        mm(a).block_until_ready()
        best_mm = min(best_mm, time.perf_counter() - start)
        start = time.perf_counter()
        np.copyto(dst, src)
        best_copy = min(best_copy, time.perf_counter() - start)
    return {"matmul_flops": 2 * 2048**3 / best_mm, "copy_bytes_per_s": src.nbytes / best_copy}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=384)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (one mini-batch)")
    parser.add_argument("--samples", type=int, default=2, help="responses per prompt")
    parser.add_argument("--only", nargs="*", help="layout names to run (default: all)")
    parser.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "split_run.json"))
    args = parser.parse_args()
    roof = roofline()
    print(f"{os.cpu_count()} CPU cores; matmul {roof['matmul_flops'] / 1e9:.1f} GFLOP/s, host copy "
          f"{roof['copy_bytes_per_s'] / 1e9:.1f} GB/s; {args.steps} steps, {args.prompts} prompts x {args.samples} "
          f"samples, "
          f"{args.new_tokens} new tokens (ignore_eos)", flush=True)
    results = {}
    for name, (processes, overrides) in layouts(args.new_tokens).items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as out_dir:
            wall = run_layout(processes, _args(out_dir, args, overrides))
            with open(os.path.join(out_dir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
        results[name] = {**summary(rows), "wall_s": wall, "processes": processes}
        r = results[name]
        floor = r["weight_bytes_sent"] / roof["copy_bytes_per_s"]
        print(f"{name:16s} step {r['step_s']:.2f} s | waits {r['wait_rollout_s']:.2f} s for sampling "
              f"{r['sampling_s']:.2f} s (gen {r['gen_s']:.2f} s): {100 * r['hidden']:.0f} % hidden | update "
              f"{r['update_s']:.2f} s | weights {r['weight_bytes_sent'] / 2**20:.2f} MiB/step, taken in "
              f"{1000 * r['weight_receive_s']:.0f} ms (copy floor {1000 * floor:.1f} ms) | wall {wall:.0f} s", flush=True)
    if "colocated" in results:
        base = results["colocated"]["step_s"]
        print("step time relative to colocated: " + ", ".join(f"{k} {v['step_s'] / base:.2f}x" for k, v in results.items()))
    if "overlap" in results:
        base = results["overlap"]["step_s"]
        print("step time relative to one-process overlap: "
              + ", ".join(f"{k} {v['step_s'] / base:.2f}x" for k, v in results.items()))
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**vars(args), "roofline": roof, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
