"""Command-line loading: --config=<recipe> plus --config.<key>=<value> overrides, in real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rlhf_jax.config import load_config_from_argv
from tests.train.helpers import run_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "configs", "grpo.py")


def run(args: list[str], cwd: str = REPO) -> subprocess.CompletedProcess:
    if args[0] == "-m" and cwd == REPO:  # python -m from the repository, which is then first on sys.path
        return run_tool(args[1], *args[2:], timeout=120)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_show_with_overrides_subprocess():
    proc = run([
        "-m", "rlhf_jax.config", "show", "--config=configs/grpo.py",
        "--config.algorithm.adv_estimator=rloo",
        "--config.actor_rollout_ref.actor.optim.lr=3e-5",
        "--config.trainer.logger=('console','jsonl')",
        "--config.data.train_files=/data/a.parquet",
        "--config.data.val_files", "/data/v1.parquet", "--config.data.val_files", "/data/v2.parquet",
        "--config.mesh.logical_axis_rules=(('batch','data'),('embed',None))",
        "--config.trainer.total_training_steps=7",
        "--config.critic.enable=true",
        "--noconfig.data.shuffle",
        "--config.reward_model.scorer_kwargs={'arithmetic': {'format_score': 0.0}}",
    ])
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["algorithm"]["adv_estimator"] == "rloo"
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] == pytest.approx(3e-5)
    assert cfg["trainer"]["logger"] == ["console", "jsonl"]
    assert cfg["data"]["train_files"] == ["/data/a.parquet"]
    assert cfg["data"]["val_files"] == ["/data/v1.parquet", "/data/v2.parquet"]
    assert cfg["mesh"]["logical_axis_rules"] == [["batch", "data"], ["embed", None]]
    assert cfg["trainer"]["total_training_steps"] == 7  # a None placeholder parsed as int
    assert cfg["critic"]["enable"] is True
    assert cfg["data"]["shuffle"] is False
    assert cfg["reward_model"]["scorer_kwargs"] == {"arithmetic": {"format_score": 0.0}}
    assert cfg["actor_rollout_ref"]["rollout"]["n"] == 16  # untouched recipe value


def test_wrong_key_fails_naming_it_subprocess():
    proc = run(["-m", "rlhf_jax.config", "show", "--config=configs/grpo.py",
                "--config.actor_rollout_ref.actor.clip_ratio_hihg=0.3"])
    assert proc.returncode != 0
    assert "actor_rollout_ref.actor.clip_ratio_hihg" in proc.stderr
    assert "did you mean 'actor_rollout_ref.actor.clip_ratio_high'" in proc.stderr


def test_wrong_type_fails_naming_key_subprocess():
    proc = run(["-m", "rlhf_jax.config", "show", "--config=configs/grpo.py", "--config.data.train_batch_size=lots"])
    assert proc.returncode != 0
    assert "config.data.train_batch_size" in proc.stderr


def test_finalize_from_command_line_subprocess():
    proc = run(["-m", "rlhf_jax.config", "show", "--finalize", "--num_devices=4", "--config=configs/grpo.py",
                "--config.mesh.tensor=2"])
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["derived"]["mesh_shape"] == [2, 1, 2, 1, 1] and cfg["derived"]["dp_size"] == 2
    assert cfg["actor_rollout_ref"]["rollout"]["response_length"] == cfg["data"]["max_response_length"] == 1
    bad = run(["-m", "rlhf_jax.config", "show", "--finalize", "--num_devices=1", "--config=configs/grpo.py",
               "--config.actor_rollout_ref.actor.ppo_mini_batch_size=5"])
    assert bad.returncode != 0 and "actor_rollout_ref.actor.ppo_mini_batch_size" in bad.stderr


def test_absl_app_script_subprocess(tmp_path):
    """How a main.py run with absl.app uses define_config_flag on the global FLAGS."""
    script = tmp_path / "train_like.py"
    script.write_text(textwrap.dedent("""
        import json
        from absl import app
        from rlhf_jax.config import define_config_flag

        CONFIG = define_config_flag()

        def main(argv):
            cfg = CONFIG.value
            print(json.dumps({"est": cfg.algorithm.adv_estimator, "n": cfg.actor_rollout_ref.rollout.n,
                              "logger": list(cfg.trainer.logger)}))

        if __name__ == "__main__":
            app.run(main)
    """))
    proc = run([str(script), f"--config={GRPO}", "--config.actor_rollout_ref.rollout.n=4",
                "--config.trainer.logger=console"], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"est": "grpo", "n": 4, "logger": ["console"]}
    bad = run([str(script), f"--config={GRPO}", "--config.trainer.total_epoch=2"], cwd=str(tmp_path))
    assert bad.returncode != 0 and "total_epoch" in bad.stderr


def test_yaml_config_with_overrides_in_process(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("algorithm:\n  adv_estimator: grpo\nactor_rollout_ref:\n  rollout:\n    n: 4\n"
                 "  actor:\n    strategy: fsdp\n")
    cfg = load_config_from_argv(["prog", f"--config={y}", "--config.actor_rollout_ref.rollout.n=2"])
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 2
    cfg = load_config_from_argv(["prog", "--config", str(y)])
    assert cfg.actor_rollout_ref.rollout.n == 4


def test_in_process_errors_and_default():
    with pytest.raises(ValueError, match=r"--config\.data\.trian_files: unknown config key.*data\.train_files"):
        load_config_from_argv(["prog", f"--config={GRPO}", "--config.data.trian_files=x"])
    with pytest.raises(ValueError, match=r"--config\.actor_rollout_ref\.actor names a section"):
        load_config_from_argv(["prog", f"--config={GRPO}", "--config.actor_rollout_ref.actor={}"])
    with pytest.raises(ValueError, match="unexpected command-line arguments: extra"):
        load_config_from_argv(["prog", f"--config={GRPO}", "extra"])
    with pytest.raises(ValueError, match="no --config"):
        load_config_from_argv(["prog"])
    cfg = load_config_from_argv(["prog", "--config.data.seed=5"], default=GRPO)
    assert cfg.data.seed == 5 and cfg.algorithm.adv_estimator == "grpo"
    with pytest.raises(AttributeError):
        cfg.data.nope = 1  # loaded configs stay locked
