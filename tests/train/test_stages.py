"""Multi-stage runs: SFT then GRPO from the SFT weights; a SIGTERM in the second stage and a rerun continue there;
a bad stage stops the run before anything loads, naming ``stages[i].<key>``."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from rlhf_jax.config.cli import load_config_from_argv
from rlhf_jax.config.stage_overrides import NAME, flatten_stage
from rlhf_jax.train.stages import DONE, stage_configs
from tests.cli_zygote import popen_module
from tests.train.helpers import REPO, cli_args, cpu_devices_flags, load_recipe, read_metrics, run_main

RECIPE = '''
import importlib.util

spec = importlib.util.spec_from_file_location("stages_recipe", {path!r})
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)


def get_config():
    cfg = recipe.get_config()
    sft, grpo = (dict(s) for s in cfg.stages)
    sft.update(data={{"train_files": ["builtin:arithmetic?max_value=4&train_size=32"]}},
               trainer={{"total_training_steps": 4, "save_freq": 2, "test_freq": 4}})
    grpo["trainer"] = {{"total_training_steps": {grpo_steps}, "save_freq": {grpo_steps}}}
    cfg.stages = (sft, grpo)
    return cfg
'''
GRPO_STEPS = 12


def _args(tmp_path, out: str) -> list[str]:
    recipe = tmp_path / "stages_recipe.py"
    recipe.write_text(RECIPE.format(path=os.path.join(REPO, "configs", "sft_grpo_stages.py"), grpo_steps=GRPO_STEPS))
    # The shared FAST overrides; a key a stage sets itself is refused in that form, so those go to the GRPO stage in
    # the per-stage form (the SFT stage keeps its own settings).
    stages = load_config_from_argv(["main", f"--config={recipe}"]).stages
    own = [flatten_stage({k: v for k, v in dict(s).items() if k != NAME}, "stage") for s in stages]
    args = [f"--config={recipe}"]
    for arg in cli_args(out)[1:]:
        key = arg[len("--config."):].split("=", 1)[0]
        if key in own[0] or key in own[1]:
            if key not in own[1]:
                args.append(arg.replace("--config.", "--config.stages.grpo.", 1))
            continue
        args.append(arg)
    return args


def _rows(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as fh:
        return sum(1 for line in fh if line.endswith("\n"))


def test_sft_then_grpo_stopped_in_the_second_stage_resumes_there(tmp_path):
    out = str(tmp_path / "run")
    sft_dir, grpo_dir = os.path.join(out, "stage_0_sft_warmup"), os.path.join(out, "stage_1_grpo")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flags(8))
    proc = popen_module("rlhf_jax.main", _args(tmp_path, out), env=env, cwd=REPO, stdout=f"{out}.out",
                        stderr=f"{out}.err")
    try:
        deadline = time.time() + 500
        while _rows(os.path.join(grpo_dir, "metrics.jsonl")) < 3 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert "stopped by SIGTERM" in stderr
    done = json.load(open(os.path.join(sft_dir, DONE)))
    assert done["step"] == 4 and os.path.exists(os.path.join(done["weights"], "model.safetensors"))
    assert not os.path.exists(os.path.join(grpo_dir, DONE))
    before = read_metrics(grpo_dir)
    stopped_at = before[-1]["step"]
    assert 3 <= stopped_at < GRPO_STEPS
    sft_log = open(os.path.join(sft_dir, "metrics.jsonl")).read()
    assert [r["step"] for r in read_metrics(sft_dir)] == [1, 2, 3, 4]
    assert "stage 1/2: sft_warmup" in stdout and f"stage 2/2: grpo (rl), from {done['weights']}" in stdout

    rerun = run_main(_args(tmp_path, out))
    assert rerun.returncode == 0 and "Traceback" not in rerun.stderr, rerun.stderr[-3000:]
    assert "stage 1/2" not in rerun.stdout and "stage 2/2: grpo" in rerun.stdout  # the first stage is not rerun
    assert open(os.path.join(sft_dir, "metrics.jsonl")).read() == sft_log
    rows = read_metrics(grpo_dir)
    assert [r["step"] for r in rows] == list(range(1, GRPO_STEPS + 1))  # none lost or repeated
    # resumed at its step: the stopped run's records stay as they were (a fresh start would move them aside)
    assert rows[:stopped_at] == before and not os.path.exists(os.path.join(grpo_dir, "metrics.jsonl.1"))
    assert json.load(open(os.path.join(grpo_dir, DONE)))["step"] == GRPO_STEPS


def _staged(changes: dict[int, dict]):
    cfg = load_recipe("sft_grpo_stages")
    cfg.stages = tuple({**stage, **changes.get(i, {})} for i, stage in enumerate(cfg.stages))
    return cfg


def test_unknown_algorithm_in_a_stage_is_named():
    with pytest.raises(ValueError, match=r"stages\[1\]\.algorithm\.type='ppo_v2' is not valid: choose one of"):
        stage_configs(_staged({1: {"algorithm": {"type": "ppo_v2"}}}))


def test_unknown_key_and_bad_value_in_a_stage_are_named():
    with pytest.raises(ValueError, match=r"stages\[0\]\.data\.train_file: unknown config key .*data\.train_files"):
        stage_configs(_staged({0: {"data": {"train_file": ["x"]}}}))
    with pytest.raises(ValueError, match=r"stages\[1\] \(grpo\): .*rollout\.n"):
        stage_configs(_staged({1: {"actor_rollout_ref.rollout.n": 1}}))  # GRPO compares samples of a prompt
    with pytest.raises(ValueError, match=r"stages\[1\]\.actor_rollout_ref\.model\.path: a stage after the first"):
        stage_configs(_staged({1: {"actor_rollout_ref.model.path": "builtin:tiny"}}))


def test_cli_stops_on_a_bad_stage_before_loading_anything(tmp_path):
    recipe = tmp_path / "bad.py"
    recipe.write_text(RECIPE.format(path=os.path.join(REPO, "configs", "sft_grpo_stages.py"), grpo_steps=2)
                      + "\n\n_good = get_config\n\ndef get_config():\n    cfg = _good()\n"
                        "    cfg.stages = (cfg.stages[0], {**cfg.stages[1], 'algorithm': {'type': 'dpo_typo'}})\n"
                        "    return cfg\n")
    proc = run_main([f"--config={recipe}", f"--config.trainer.default_local_dir={tmp_path / 'run'}"], devices=1)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: stages[1].algorithm.type='dpo_typo' is not valid")
    assert not os.path.exists(tmp_path / "run" / "stage_0_sft_warmup")


def test_sft_keys_in_an_rl_stage_are_refused():
    """A key only SFT reads, inherited by the GRPO stage from the shared config, would do nothing there."""
    cfg = load_recipe("sft_grpo_stages")
    cfg.data.response_key = "answer"
    with pytest.raises(ValueError, match=r"stages\[1\] \(grpo\): data\.response_key='answer' is read by SFT only"):
        stage_configs(cfg)
    cfg.data.response_key = None
    cfg.stages = ({**cfg.stages[0], "data.response_key": "answer"}, cfg.stages[1])
    assert stage_configs(cfg)[0][2].data.response_key == "answer"
