"""SIGTERM / SIGINT during training: exit 0 with a checkpoint of the last finished step; resuming continues exactly."""

import os
import random
import signal
import subprocess
import time

import pytest

from rlhf_jax.runtime.checkpoint import Checkpointer
from tests.cli_zygote import popen_module
from tests.train.helpers import REPO, Processes, cli_args, cpu_devices_flags, read_metrics, run_main
from tests.train.test_resume import _assert_same_rows

TOTAL = 20
ONE_DEVICE = {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}
# Checkpoints only at the end: the one a stopped run leaves is the stop's own.
LONG = {"trainer.total_training_steps": TOTAL, "trainer.save_freq": TOTAL, **ONE_DEVICE}


def _env(devices: int, **extra) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flags(devices), **extra)


def _rows(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.endswith("\n"))


def _signal_after(procs: list[subprocess.Popen], out: str, steps: int, sig: int, target: int = -1) -> None:
    """Send ``sig`` to ``procs[target]`` once ``out`` has logged ``steps`` steps."""
    deadline = time.time() + 500
    while _rows(out) < steps and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    assert all(p.poll() is None for p in procs), "the run ended before the signal"
    procs[target].send_signal(sig)


def _latest(out: str) -> tuple[int | None, list[int]]:
    ckpt = Checkpointer(os.path.join(out, "checkpoints"), async_save=False)
    try:
        return ckpt.latest_step(), ckpt.all_steps()
    finally:
        ckpt.close()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("full"))
    proc = run_main(cli_args(out, **LONG), devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))
    return rows


def test_sigterm_at_a_random_step_checkpoints_and_resumes_exactly(tmp_path, uninterrupted):
    # SIGTERM (what a preemptible machine gets) here; SIGINT (Ctrl-C), which the same handler takes, in the
    # two-process test.
    sig = signal.SIGTERM
    out = str(tmp_path / "run")
    at = random.randint(1, TOTAL // 2)
    proc = popen_module("rlhf_jax.main", cli_args(out, **LONG), env=_env(1), cwd=REPO, stdout=f"{out}.out",
                        stderr=f"{out}.err")
    try:
        _signal_after([proc], out, at, sig)
        started = time.time()
        stdout, stderr = proc.communicate(timeout=120)
        took = time.time() - started
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and f"stopped by {signal.Signals(sig).name}" in stderr, stderr[-3000:]
    logged = read_metrics(out)
    stopped_at = logged[-1]["step"]
    assert [r["step"] for r in logged] == list(range(1, stopped_at + 1)) and at <= stopped_at < TOTAL
    # A checkpoint of the step it stopped at, and no other (save_freq=TOTAL saves only at the end).
    assert _latest(out) == (stopped_at, [stopped_at])
    assert took < 60, f"stopping took {took:.0f}s"

    resumed = run_main(cli_args(out, **LONG), devices=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))  # no step lost, none repeated
    for a, b in zip(uninterrupted, rows):
        _assert_same_rows(a, b)


def test_ctrl_c_to_one_of_two_processes_stops_both_at_the_same_step(tmp_path):
    """Only process 1 gets the signal (SIGINT); both must stop after the same step and write one checkpoint together."""
    out = str(tmp_path / "run")
    args = cli_args(out, **{**LONG, "mesh.data": -1})
    procs = Processes(2, 2, args).procs
    try:
        _signal_after(procs, out, random.randint(1, 4), signal.SIGINT, target=1)
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, stderr) in zip(procs, outputs):
        assert p.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert "SIGINT received: stopping after the current step" in outputs[1][1]  # process 1's own handler ran
    stopped_at = read_metrics(out)[-1]["step"]
    assert stopped_at < TOTAL and _latest(out) == (stopped_at, [stopped_at])
    assert f"stopped by a signal to another process at step {stopped_at}/" in outputs[0][1]  # process 0 reports


SIGNALLING_REWARD = '''
import os, signal

calls = 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    if calls == int(os.environ.get("SIGTERM_AT_CALL", "0")):
        os.kill(os.getpid(), signal.SIGTERM)
    return {"score": sum(ch.isdigit() for ch in solution_str) / 4.0 + 0.1 * len(solution_str)}
'''


def test_sigterm_during_scoring_abandons_the_step_and_resumes_exactly(tmp_path, monkeypatch):
    """A signal while the rewards are computed abandons that step (nothing has changed yet): the checkpoint holds
    the step before, and the resumed run samples the abandoned step's prompts again, as the uninterrupted run did."""
    from rlhf_jax.runtime.preemption import StopRequest
    from rlhf_jax.train.trainer import Trainer
    from tests.train.helpers import make_config

    total, per_step = 5, 8  # 4 prompts x 2 samples scored per step
    rewards = {}
    for name in ("full", "split"):  # a module is imported once per path: each run set counts its own calls
        rewards[name] = str(tmp_path / f"reward_{name}.py")
        with open(rewards[name], "w") as f:
            f.write(SIGNALLING_REWARD)
    common = {"trainer.total_training_steps": total, "trainer.save_freq": total}
    full = str(tmp_path / "full")
    Trainer(make_config(full, **common, custom_reward_function__path=rewards["full"]), stop=StopRequest()).fit()
    common["custom_reward_function.path"] = rewards["split"]

    split = str(tmp_path / "split")
    monkeypatch.setenv("SIGTERM_AT_CALL", str(2 * per_step + 1))  # the first score of step 3
    Trainer(make_config(split, **common), stop=StopRequest()).fit()
    assert [r["step"] for r in read_metrics(split)] == [1, 2]
    assert _latest(split) == (2, [2])
    monkeypatch.delenv("SIGTERM_AT_CALL")
    Trainer(make_config(split, **common), stop=StopRequest()).fit()
    rows = read_metrics(split)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    for a, b in zip(read_metrics(full), rows):
        _assert_same_rows(a, b)
