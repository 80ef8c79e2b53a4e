"""Checkpoint and resume: deterministic continuation, epoch boundaries, a SIGKILL in the middle of a save."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from rlhf_jax.runtime.checkpoint import Checkpointer
from rlhf_jax.train.trainer import Trainer
from tests.cli_zygote import popen_module
from tests.train.helpers import REPO, cli_args, cpu_devices_flags, make_config, read_metrics

# Metrics that are wall-clock measurements (or memory) and legitimately differ between runs.
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/")


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _assert_same_rows(a: dict, b: dict):
    a, b = _comparable(a), _comparable(b)
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], float):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-6, err_msg=k)
        else:
            assert a[k] == b[k], k


def _params(trainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(trainer.actor.params)]


def _resume_matches(tmp_path, total: int, first: int, **overrides):
    full_dir, split_dir = str(tmp_path / "full"), str(tmp_path / "split")
    full = Trainer(make_config(full_dir, **{"trainer.total_training_steps": total, "trainer.save_freq": first, **overrides}))
    full.fit()
    # The same run, stopped after `first` steps ...
    Trainer(make_config(split_dir, **{"trainer.total_training_steps": first, "trainer.save_freq": first, **overrides})).fit()
    # ... and resumed (resume_mode=auto) to the end.
    resumed = Trainer(make_config(split_dir, **{"trainer.total_training_steps": total, "trainer.save_freq": first, **overrides}))
    resumed.fit()
    full_rows, split_rows = read_metrics(full_dir), read_metrics(split_dir)
    assert [r["step"] for r in split_rows] == list(range(1, total + 1))
    for step in range(first + 1, total + 1):
        _assert_same_rows(full_rows[step - 1], split_rows[step - 1])
    for a, b in zip(_params(full), _params(resumed)):
        np.testing.assert_array_equal(a, b)
    return full_rows


def test_resume_mid_epoch_is_deterministic(tmp_path):
    rows = _resume_matches(tmp_path, total=4, first=2)
    # The steps really differ from each other (and learn): the comparison above is not between constants.
    assert rows[2]["actor/pg_loss"] != rows[3]["actor/pg_loss"] and rows[3]["actor/grad_norm"] > 0


def test_resume_exactly_at_an_epoch_boundary(tmp_path):
    # 8 prompts / 4 per step = 2 steps per epoch: stop after step 2 (end of epoch 0), resume into epoch 1.
    rows = _resume_matches(tmp_path, total=4, first=2, **{"data.train_files": ("builtin:arithmetic?max_value=4&train_size=8",)})
    assert [r["training/epoch"] for r in rows] == [0, 0, 1, 1]


def test_sigkill_during_checkpoint_save_resumes_from_previous(tmp_path):
    out = str(tmp_path / "run")
    ckpt_dir = os.path.join(out, "checkpoints")
    args = cli_args(out, **{"trainer.total_training_steps": 40, "trainer.save_freq": 1,
                            "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1})
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flags(1))
    proc = popen_module("rlhf_jax.main", args, env=env, cwd=REPO)
    killed_during_save = False
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
            complete = [n for n in names if n.isdigit()]
            in_progress = [n for n in names if "tmp" in n]
            if in_progress and len(complete) >= 2:
                proc.send_signal(signal.SIGKILL)
                killed_during_save = True
                break
            time.sleep(0.0005)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert killed_during_save, "the run ended before a save could be interrupted"

    ckpt = Checkpointer(ckpt_dir, async_save=False)
    last_complete = ckpt.latest_step()
    ckpt.close()
    assert last_complete is not None and last_complete >= 2
    # Resume (auto) from the last complete checkpoint and run two more steps.
    env_args = cli_args(out, **{"trainer.total_training_steps": last_complete + 2, "trainer.save_freq": 1,
                                "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "trainer.logger": ("console", "jsonl")})
    done = subprocess.run([sys.executable, "-m", "rlhf_jax.main", *env_args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {ckpt_dir}/{last_complete}" in done.stdout
    ckpt = Checkpointer(ckpt_dir, async_save=False)
    assert ckpt.latest_step() == last_complete + 2
    ckpt.close()
