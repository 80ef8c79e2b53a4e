"""The watchdog of a split run (rlhf_jax/parallel/watchdog.py) against the real key-value store of a one-process
jax.distributed run, with pretend peers; the four-process behaviour (a killed process stops every other) is in
tests/train/test_split_run.py."""

from __future__ import annotations

import json
import os

import pytest

from rlhf_jax.parallel.watchdog import lost_a_peer, silence_limit_s
from tests.cli_zygote import run_module
from tests.parallel.rehearsal import free_port
from tests.train.helpers import REPO


def _watch(scenario: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = run_module("tests.parallel.watchdog_worker", [str(free_port()), scenario], env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_silent_peer_stops_the_process_with_one_line_naming_it_and_what_this_process_did():
    out = _watch("silent")
    assert len(out["left"]) == 1 and 2.0 < out["after_s"] < 4.0, out
    line = out["left"][0]
    assert line.startswith("process 0: step 1: training: process 1 stopped responding (no sign of life for 2 s)"), line
    assert "process 2" not in line and "\n" not in line  # process 2 lives


def test_a_finished_peer_is_not_watched():
    assert _watch("done")["left"] == []


def test_the_stop_word_of_another_process_stops_this_one_with_it():
    out = _watch("abort")
    assert out["left"] == ["process 2: step 3: receiving weights from process 0 failed"] and out["after_s"] < 1.5


@pytest.mark.parametrize("error, lost", [
    (RuntimeError("UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error 127.0.0.1:5: Connection reset by peer"),
     True),
    (ValueError("data.train_batch_size=3 must divide ..."), False),
])
def test_errors_a_lost_peer_causes_wait_for_the_watchdogs_verdict(error, lost):
    assert lost_a_peer(error) is lost


def test_peers_are_called_gone_well_before_the_runtimes_own_heartbeat_timeout():
    assert silence_limit_s(100) == 40 and silence_limit_s(30) == 12 and silence_limit_s(2) == 3
