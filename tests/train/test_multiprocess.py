"""Two JAX processes (2 fake CPU devices each) over gloo on 127.0.0.1 train exactly like one process with 4 devices."""

import os
import socket
import subprocess
import sys

import pytest

from tests.train.helpers import REPO, cli_args, read_metrics, run_main

KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss",
        "response_length/mean", "val-core/arithmetic/reward/mean@1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process(tmp_path):
    overrides = {"trainer.total_training_steps": 2, "trainer.test_freq": 2, "mesh.data": -1, "mesh.fsdp": 1,
                 "mesh.tensor": 1, "trainer.logger": ("console", "jsonl")}
    single = str(tmp_path / "single")
    proc = run_main(cli_args(single, **overrides), devices=4)
    assert proc.returncode == 0, proc.stderr[-3000:]

    multi = str(tmp_path / "multi")
    env = dict(os.environ, RLHF_JAX_PORT=str(_free_port()),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    launched = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", "2",
                               *cli_args(multi, **overrides)], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600, stdin=subprocess.DEVNULL)
    assert launched.returncode == 0, launched.stderr[-3000:]
    one, two = read_metrics(single), read_metrics(multi)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    assert "val-core/arithmetic/reward/mean@1" in one[-1]  # validation ran at the end, over both processes' prompts
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key in (k for k in KEYS if k in a):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
