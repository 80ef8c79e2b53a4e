"""Command-line overrides in a config with stages: every key a stage sets, overridden on the command line, is
either refused by name (with the per-stage form) or, in the per-stage form, reaches that stage's finalized config."""

from __future__ import annotations

import glob
import os

import pytest

from rlhf_jax.config import schema
from rlhf_jax.config.cli import load_config_from_argv
from rlhf_jax.config.stage_overrides import NAME, flatten_stage
from rlhf_jax.config.yaml_import import coerce
from rlhf_jax.train.stages import stage_configs
from tests.train.helpers import REPO, run_main


def _recipes_with_stages() -> list[str]:
    found = []
    for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.py"))):
        with open(path) as f:
            if "cfg.stages" in f.read():
                found.append(path)
    return found


RECIPES = _recipes_with_stages()


def _stage_keys(recipe: str) -> list[tuple[int, str, object]]:
    """(stage index, key, value) of every key each stage of ``recipe`` sets."""
    cfg = load_config_from_argv(["main", f"--config={recipe}"])
    keys = []
    for i, stage in enumerate(cfg.stages):
        own = {k: v for k, v in dict(stage).items() if k != NAME}
        keys += [(i, k, v) for k, v in flatten_stage(own, f"stages[{i}]").items()]
    return keys


def _changed(key: str, value):
    """Another valid value of ``key`` where one is obvious (so that reaching the stage is visible), else ``value``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value * 2 if value > 0 else value  # doubling keeps batch sizes divisible by the mesh
    if isinstance(value, float):
        return value / 2
    return value


def _cli(value) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(repr(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def test_there_are_recipes_with_stages():
    assert {os.path.basename(r) for r in RECIPES} >= {"grpo_tool.py", "sft_grpo_stages.py"}


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_every_key_a_stage_sets_is_refused_by_name_on_the_command_line(recipe):
    keys = _stage_keys(recipe)
    assert keys
    for key in sorted({k for _, k, _ in keys}):
        setters = sorted({i for i, k, _ in keys if k == key})
        value = _cli(next(v for _, k, v in keys if k == key))
        with pytest.raises(ValueError) as e:
            load_config_from_argv(["main", f"--config={recipe}", f"--config.{key}={value}"])
        message = str(e.value)
        assert message.startswith(f"--config.{key}: "), message
        for i in setters:
            assert f"stages[{i}]" in message and f"--config.stages.{i}.{key}={value}" in message, message


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_every_key_a_stage_sets_reaches_that_stage_in_the_per_stage_form(recipe, tmp_path):
    keys = _stage_keys(recipe)
    cfg = load_config_from_argv(["main", f"--config={recipe}"])
    names = [dict(s)[NAME] for s in cfg.stages]
    args = [f"--config={recipe}", f"--config.trainer.default_local_dir={tmp_path}"]
    want = {}
    for n, (i, key, value) in enumerate(keys):
        new = _changed(key, value)
        selector = names[i] if n % 2 else str(i)  # by position and by stage_name
        args.append(f"--config.stages.{selector}.{key}={_cli(new)}")
        want[(i, key)] = coerce(schema.get_key(key), new)
    stages = stage_configs(load_config_from_argv(["main", *args]))
    for (i, key), value in want.items():
        assert schema.get_path(stages[i][2], key) == value, (i, key)
    # the keys no stage sets still come from the shared config
    for i, (_, _, c) in enumerate(stages):
        assert c.trainer.project_name == cfg.trainer.project_name


def test_the_command_line_refuses_in_one_line_and_nothing_after(tmp_path):
    proc = run_main([f"--config={os.path.join(REPO, 'configs', 'grpo_tool.py')}",
                     f"--config.trainer.default_local_dir={tmp_path / 'run'}",
                     "--config.trainer.total_training_steps=3"], devices=1, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "config error: --config.trainer.total_training_steps: stages[0] (sft_warmup) and stages[1] (grpo) set "
        "trainer.total_training_steps themselves, which would win over this override; set it per stage: "
        "--config.stages.0.trainer.total_training_steps=3 --config.stages.1.trainer.total_training_steps=3"]
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("arg, error", [
    ("--config.stages.2.trainer.total_training_steps=3",
     "no stage '2'; the config's stages are: 0 (sft_warmup), 1 (grpo)"),
    ("--config.stages.grpo.trainer.total_trainng_steps=3",
     "unknown config key 'trainer.total_trainng_steps' (did you mean 'trainer.total_training_steps'?)"),
    ("--config.stages.0.trainer.total_training_steps=x", "trainer.total_training_steps: expected int, got 'x'"),
])
def test_bad_per_stage_overrides_name_the_argument(arg, error):
    with pytest.raises(ValueError) as e:
        load_config_from_argv(["main", f"--config={os.path.join(REPO, 'configs', 'grpo_tool.py')}", arg])
    assert str(e.value).startswith(arg.split("=")[0] + ": ") and error in str(e.value), str(e.value)


def test_per_stage_overrides_need_stages():
    with pytest.raises(ValueError, match=r"^--config.stages.0.trainer.total_training_steps: this config has no stages"):
        load_config_from_argv(["main", f"--config={os.path.join(REPO, 'configs', 'grpo.py')}",
                               "--config.stages.0.trainer.total_training_steps=3"])
