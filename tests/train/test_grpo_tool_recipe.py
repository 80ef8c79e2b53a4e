"""configs/grpo_tool.py end to end with tiny step counts (set per stage on the command line): the SFT warm-up on
calculator demonstrations, then GRPO whose multi-turn rollouts run the calculator, each stage's metrics written."""

from __future__ import annotations

import os

from rlhf_jax.train.stages import stage_configs
from tests.train.helpers import REPO, load_recipe, read_metrics, run_main

RECIPE = '''
import importlib.util

spec = importlib.util.spec_from_file_location("grpo_tool_recipe", {path!r})
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)


def get_config():
    cfg = recipe.get_config()
    cfg.data.train_files = ("builtin:calculator_demos?train_size=16",)
    cfg.data.val_files = ("builtin:calculator_demos?test_size=4",)
    cfg.data.train_batch_size = 2
    cfg.data.val_batch_size = 4
    cfg.actor_rollout_ref.rollout.n = 2
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 2
    cfg.trainer.logger = ("jsonl",)
    cfg.trainer.save_hf_checkpoint = "never"
    cfg.mesh.data = cfg.mesh.fsdp = cfg.mesh.tensor = 1
    return cfg
'''


def test_recipe_stages_finalize_as_shipped():
    (_, _, sft), (_, _, grpo) = stage_configs(load_recipe("grpo_tool"))
    assert sft.algorithm.type == "sft" and sft.data.multiturn.enable
    assert grpo.algorithm.type == "rl" and grpo.actor_rollout_ref.rollout.multi_turn.enable
    assert grpo.actor_rollout_ref.rollout.multi_turn.tools == ("calculator",)
    assert all(f.startswith("builtin:calculator_demos") for f in sft.data.train_files + grpo.data.train_files)


def test_recipe_runs_both_stages(tmp_path):
    recipe = tmp_path / "grpo_tool_recipe.py"
    recipe.write_text(RECIPE.format(path=os.path.join(REPO, "configs", "grpo_tool.py")))
    out = str(tmp_path / "run")
    # the stages' own sizes, set per stage on the command line (by position and by stage_name)
    per_stage = {"0.data.train_batch_size": 4, "0.trainer.total_training_steps": 2, "sft_warmup.trainer.test_freq": 2,
                 "0.trainer.save_freq": 2, "grpo.trainer.total_training_steps": 1, "1.trainer.test_freq": 1,
                 "grpo.trainer.save_freq": 1}
    proc = run_main([f"--config={recipe}", f"--config.trainer.default_local_dir={out}",
                     *(f"--config.stages.{k}={v}" for k, v in per_stage.items())], devices=1)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    sft = read_metrics(os.path.join(out, "stage_0_sft_warmup"))
    assert [r["step"] for r in sft if "train/loss" in r] == [1, 2]
    grpo = read_metrics(os.path.join(out, "stage_1_grpo"))
    last = grpo[-1]
    assert last["step"] == 1
    for name in ("num_turns/mean", "tool_calls/mean", "device_idle_fraction", "masked_token_fraction"):
        assert f"multi_turn/{name}" in last, name
    assert any(k.startswith("val-core/arithmetic/") for k in grpo[0])  # validation before GRPO, with the tool
