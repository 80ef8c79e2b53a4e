"""Shared pieces of the dialect-file run tests: small local data sets and first-step metric comparison."""

from __future__ import annotations

import json
import math
import os

from tests.train.helpers import read_metrics, run_main

# Metrics that measure the machine, not the computation.
_TIMING = ("timing", "perf/", "time/", "throughput", "mfu", "memory", "idle", "latency")


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def conversations(path: str, n: int = 16) -> str:
    """Two-turn chats whose final assistant message is the sum."""
    return write_jsonl(path, [{"messages": [
        {"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)},
        {"role": "user", "content": f"and {i}+2?"}, {"role": "assistant", "content": str(i + 2)}]}
        for i in range(n)])


def pairs(path: str, n: int = 16) -> str:
    return write_jsonl(path, [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 3)} for i in range(n)])


def run_file(config: str, overrides: dict, *, env: dict | None = None):
    args = [f"--config={config}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
    return run_main(args, devices=1, env=env)


def first_step_metrics(out: str) -> dict[str, float]:
    row = next(r for r in read_metrics(out) if "training/global_step" in r)  # the first training step
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not any(t in k for t in _TIMING)}


def assert_same_first_step(a: str, b: str, tol: float = 1e-6) -> None:
    ma, mb = first_step_metrics(a), first_step_metrics(b)
    assert set(ma) == set(mb), set(ma) ^ set(mb)
    assert any("loss" in k for k in ma), sorted(ma)
    for k in ma:
        if not (math.isnan(ma[k]) and math.isnan(mb[k])):
            assert abs(ma[k] - mb[k]) <= tol, (k, ma[k], mb[k])


def ran_two_steps(proc, out: str, fmt: str) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(f"{fmt} keys have no meaning in rlhf_jax") <= 1
    assert len(read_metrics(out)) >= 2 and os.path.isdir(os.path.join(out, "checkpoints", "2"))
