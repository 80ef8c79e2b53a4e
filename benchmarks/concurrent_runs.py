"""Stress: several multi-device command-line runs at once, round after round, watching for a stalled collective.

Each round starts ``--runs`` copies of ``python -m rlhf_jax.main`` (the tiny default recipe, two steps, eight
fake CPU devices as a 2 x 2 x 2 mesh) at the same moment, so that their XLA:CPU collectives (all-reduces and
all-gathers whose eight participant threads must all arrive) compete for the same cores. A run that has not
finished after ``--stall-s`` seconds counts as stalled: its Python threads are dumped with py-spy (when
installed) into the report, then it is killed. XLA:CPU's own collective timeout is left at its default (40 s:
a participant that waits that long aborts the process), so a stall shows as an abort or as a run past the limit.

    python benchmarks/concurrent_runs.py --rounds 10 --runs 4     # writes benchmarks/results/concurrent_runs.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config=configs/grpo.py", "--config.trainer.total_training_steps=2", "--config.trainer.test_freq=0",
        "--config.trainer.val_before_train=False", "--config.mesh.data=2", "--config.mesh.fsdp=2",
        "--config.mesh.tensor=2", "--config.trainer.logger=['jsonl']"]


def dump_threads(pid: int) -> str:
    if shutil.which("py-spy") is None:
        return "(py-spy not installed)"
    proc = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    return proc.stdout[-6000:] + proc.stderr[-2000:]


def one_round(runs: int, stall_s: float, work: str, index: int) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    procs = []
    for i in range(runs):
        out = os.path.join(work, f"round{index}_run{i}")
        log = open(out + ".log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "rlhf_jax.main", *ARGS,
                                        f"--config.trainer.default_local_dir={out}"], cwd=REPO, env=env,
                                       stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), out, log))
    start = time.monotonic()
    results = []
    for proc, out, log in procs:
        left = max(1.0, stall_s - (time.monotonic() - start))
        try:
            code, dump = proc.wait(timeout=left), None
        except subprocess.TimeoutExpired:
            dump = dump_threads(proc.pid)
            proc.kill()
            code = proc.wait()
        log.close()
        with open(out + ".log") as f:
            tail = f.read()[-1500:]
        results.append({"returncode": code, "wall_s": round(time.monotonic() - start, 1), "stalled": dump is not None,
                        "dump": dump, "log_tail": tail if code != 0 else ""})
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=4, help="runs started together in each round")
    ap.add_argument("--stall-s", type=float, default=600, help="a run still going after this long has stalled")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "concurrent_runs.json"))
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="concurrent_runs_")
    rounds = []
    for r in range(args.rounds):
        results = one_round(args.runs, args.stall_s, work, r)
        rounds.append(results)
        bad = [x for x in results if x["returncode"] != 0 or x["stalled"]]
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{x['wall_s']:.0f} s" for x in results)
              + (f"; {len(bad)} failed or stalled" if bad else "; all finished"), flush=True)
    failures = sum(1 for rs in rounds for x in rs if x["returncode"] != 0 or x["stalled"])
    summary = {"rounds": args.rounds, "runs_per_round": args.runs, "failures": failures,
               "max_wall_s": max(x["wall_s"] for rs in rounds for x in rs), "results": rounds}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{args.rounds * args.runs} runs, {failures} failed or stalled, longest {summary['max_wall_s']} s; "
          f"wrote {args.out}")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
