"""A run whose sampling and training happen on different processes (mesh.rollout_processes): four processes of
two fake CPU devices over gloo, two sampling and two training, train like one process of eight devices with
mesh.rollout_devices=4 and experience.overlap (the same schedule: batch k sampled with the weights of update
k - 1), step for step, to the same weights."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from rlhf_jax.models.safetensors_io import LazyFile
from tests.train.helpers import REPO, cli_args, read_metrics, run_main

STEPS = 4
COMMON = {"trainer.total_training_steps": STEPS, "trainer.save_hf_checkpoint": "last", "mesh.data": 2,
          "mesh.fsdp": 2, "mesh.tensor": 1, "experience.overlap": True, "trainer.logger": ("jsonl",)}
KEYS = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
        "actor/grad_norm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _split_run(out: str, timeout: float = 600, **overrides) -> subprocess.CompletedProcess:
    env = dict(os.environ, RLHF_JAX_PORT=str(_free_port()),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    args = cli_args(out, **{**COMMON, "mesh.rollout_processes": 2, "mesh.handoff_timeout_s": 120.0, **overrides})
    return subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "4", "2", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _weights(out: str) -> LazyFile:
    return LazyFile(os.path.join(out, "hf", f"global_step_{STEPS}", "model.safetensors"))


def test_two_sampling_and_two_training_processes_train_like_one_process_with_overlap(tmp_path):
    single, split = str(tmp_path / "single"), str(tmp_path / "split")
    proc = run_main(cli_args(single, **{**COMMON, "mesh.rollout_devices": 4}), devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _split_run(split)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = read_metrics(single), read_metrics(split)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    assert one[-1]["actor/grad_norm"] > 0
    reference = _weights(single)
    for name in reference.keys():
        np.testing.assert_allclose(_weights(split).get(name), reference.get(name), rtol=1e-6, atol=1e-6, err_msg=name)
