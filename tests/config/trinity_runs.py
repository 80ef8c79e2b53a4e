"""Shared pieces of the dialect-file run tests: small local data sets, runs of a file, and the settings a converted
file reads to."""

from __future__ import annotations

import json
import os

from tests.train.helpers import read_metrics, run_main


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


def run_args(config: str, overrides: dict) -> list[str]:
    return [f"--config={config}"] + [f"--config.{k}={v}" for k, v in overrides.items()]


def run_file(config: str, overrides: dict, *, env: dict | None = None):
    return run_main(run_args(config, overrides), devices=1, env=env)


def settings(config: str, overrides: dict) -> dict:
    """Every setting a run of ``config`` with ``overrides`` reads, as the command line builds them."""
    from rlhf_jax.config.cli import load_config_from_argv

    return load_config_from_argv(["rlhf_jax.main"] + run_args(config, overrides)).to_dict()


def assert_same_settings(original: str, converted: str, overrides: dict) -> None:
    """A converted file, with the same overrides, reads to every setting its original does. A run is a function of
    its settings and seed (the bit-exact resume tests), so the two train alike: the original's run stands for both
    (a second run would only repeat it)."""
    a, b = settings(original, overrides), settings(converted, overrides)

    def flat(d, prefix=""):
        for k, v in d.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]

    fa, fb = dict(flat(a)), dict(flat(b))
    differing = sorted(k for k in fa.keys() | fb.keys() if fa.get(k, "<absent>") != fb.get(k, "<absent>"))
    assert not differing, [(k, fa.get(k, "<absent>"), fb.get(k, "<absent>")) for k in differing[:5]]


def ran_two_steps(proc, out: str, fmt: str) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(f"{fmt} keys have no meaning in rlhf_jax") <= 1
    assert len(read_metrics(out)) >= 2 and os.path.isdir(os.path.join(out, "checkpoints", "2"))
