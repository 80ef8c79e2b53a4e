"""``rlhf_jax.generate`` then ``rlhf_jax.evaluate`` reproduce the trainer's validation metrics on the same data."""

import json
import os
import subprocess

import pandas as pd
import pytest

from rlhf_jax.evaluate import metrics_of, pass_at_k
from tests.train.helpers import REPO, cli_args, cpu_devices_flags, read_metrics, run_main, run_tool

DATA = "builtin:arithmetic?max_value=4&test_size=6"
REWARD = os.path.join(REPO, "tests", "train", "dense_reward.py")  # continuous scores: equality means something
SETTINGS = {"n": 3, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "batch": 4, "seed": 5}


def _tool(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flags(1))
    return run_tool(module, *args, env=env, timeout=600)


def test_generate_then_evaluate_matches_validation(tmp_path):
    s = SETTINGS
    v = "actor_rollout_ref.rollout.val_kwargs."
    # The trainer's validation only, on one device.
    run = str(tmp_path / "run")
    proc = run_main(cli_args(run, **{"trainer.val_only": True, "data.val_files": (DATA,), "data.val_batch_size": s["batch"],
                                     v + "n": s["n"], v + "temperature": s["temperature"], v + "top_p": s["top_p"],
                                     v + "top_k": s["top_k"], v + "do_sample": True, "trainer.seed": s["seed"],
                                     "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}), devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (val,) = read_metrics(run)
    # The same prompts and settings in verl's generation keys.
    out = str(tmp_path / "gen.parquet")
    gen = _tool("rlhf_jax.generate", f"data.path={DATA}", "model.path=builtin:tiny", f"data.n_samples={s['n']}",
                f"data.batch_size={s['batch']}", f"data.output_path={out}", f"rollout.temperature={s['temperature']}",
                f"rollout.top_p={s['top_p']}", f"rollout.top_k={s['top_k']}", "rollout.prompt_length=16",
                "rollout.response_length=4", "data.prompt_template=raw", f"trainer.seed={s['seed']}",
                "trainer.nnodes=1", "trainer.n_gpus_per_node=1", "trainer.device=cuda",
                "rollout.gpu_memory_utilization=0.5")
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert "ignoring verl keys with no meaning in rlhf_jax: trainer.device, rollout.gpu_memory_utilization" \
        in gen.stderr
    frame = pd.read_parquet(out)
    assert len(frame) == 6 and all(len(r) == s["n"] for r in frame["responses"])
    assert {"data_source", "prompt", "reward_model", "responses"} <= set(frame.columns)
    ev = _tool("rlhf_jax.evaluate", f"data.path={out}", f"custom_reward_function.path={REWARD}")
    assert ev.returncode == 0, ev.stderr[-3000:]
    metrics = json.loads(ev.stdout.strip().splitlines()[-1])
    for key in (f"val-core/arithmetic/reward/mean@{s['n']}", f"val-core/arithmetic/reward/best@{s['n']}/mean"):
        assert metrics[key] == pytest.approx(val[key], rel=1e-6), key
    assert metrics["test_score/arithmetic"] == metrics[f"val-core/arithmetic/reward/mean@{s['n']}"]
    assert {"pass@1/arithmetic", "pass@2/arithmetic"} <= metrics.keys()


def test_unknown_and_missing_keys_are_errors(tmp_path):
    proc = _tool("rlhf_jax.generate", "data.path=builtin:arithmetic", "rollout.temprature=1.0",
                 f"data.output_path={tmp_path / 'o.parquet'}")
    assert proc.returncode == 2 and "unknown key 'rollout.temprature'" in proc.stderr
    proc = _tool("rlhf_jax.evaluate", f"data.path={tmp_path / 'missing.parquet'}")
    assert proc.returncode == 2 and "data.path" in proc.stderr and "Traceback" not in proc.stderr


def test_pass_at_k_and_metrics():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 2) == pytest.approx(0.5)
    m = metrics_of({"a": [[1.0, 0.0], [0.0, 0.0]]}, pass_score=1.0)
    assert m["test_score/a"] == 0.25 and m["val-core/a/reward/best@2/mean"] == 0.5
    assert m["pass@1/a"] == 0.25 and m["pass@2/a"] == 0.5


def test_generate_samples_multi_turn_trajectories_as_validation_does(tmp_path):
    """With multi_turn.enable, generate writes the whole trajectories (tool responses included), the same texts the
    trainer's validation dumps for the same prompts and settings."""
    from rlhf_jax.generate import generate
    from rlhf_jax.train.trainer import Trainer
    from tests.train.helpers import make_config
    from tests.train.test_multi_turn_train import MT, TURNS  # registers the test parser and the test_digits tool

    v = "actor_rollout_ref.rollout.val_kwargs."
    settings = {**TURNS, MT + "tools": ("test_digits",), MT + "format": "test_first_two_turns", v + "n": 2,
                v + "temperature": 1.0, v + "do_sample": True, "data.val_batch_size": 4,
                "data.val_files": ("builtin:arithmetic?max_value=4&test_size=6",),
                "trainer.validation_data_dir": str(tmp_path / "val")}
    trainer = Trainer(make_config(str(tmp_path / "run"), "grpo", **settings))
    trainer.validate(0)
    trainer.close()
    dumped = [json.loads(line)["output"] for line in open(tmp_path / "val" / "0.jsonl")]
    rows = generate(make_config(str(tmp_path / "gen_run"), "grpo", **settings), str(tmp_path / "gen.parquet"))
    responses = [r for row in rows for r in row["responses"]]
    assert len(responses) == 12 and responses == dumped
    assert all(r.count("tool") >= 2 for r in responses)  # every trajectory has the test parser's tool turns
    frame = pd.read_parquet(tmp_path / "gen.parquet")
    assert [list(r) for r in frame["responses"]] == [row["responses"] for row in rows]
