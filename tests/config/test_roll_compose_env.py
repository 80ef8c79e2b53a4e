"""ROLL's files as Hydra primary configs: the defaults list composed (relative files, packages, _self_, overrides,
${...} across the parts) and system_envs applied to the process before anything reads them."""

import os
import textwrap

import pytest

from rlhf_jax.config import hydra_compose
from rlhf_jax.config.dialects.rules import _resolved
from rlhf_jax.config.yaml_import import load_yaml, read_yaml
from rlhf_jax.runtime import process_env
from tests.train.helpers import run_main

HERE = os.path.dirname(__file__)
AGENTIC = os.path.join(HERE, "dialects", "roll", "examples", "qwen2.5-0.5B-agentic", "agent_val_frozen_lake.yaml")
BASE = "rollout_batch_size: 4\nresponse_length: 8\nadv_estimator: grpo\nnorm_mean_type: group\n"


def _write(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_roll_agentic_file_composes_its_envs_and_resolves_references_into_them():
    mapping, _ = read_yaml(AGENTIC)
    composed = _resolved(hydra_compose.compose(mapping, AGENTIC))
    assert "defaults" not in composed
    sokoban = composed["custom_envs"]["SimpleSokoban"]  # ${custom_env.SimpleSokoban}, from ../config/traj_envs.yaml
    assert sokoban["env_type"] == "sokoban" and sokoban["env_config"]["dim_room"] == [6, 6]
    assert sokoban["env_config"]["format_penalty"] == -0.15  # ${sokoban_format_penalty} of the composed file
    # the primary file's max_tokens_per_step: 64 wins over traj_envs' 128, in every reference to it
    assert composed["max_tokens_per_step"] == 64 and sokoban["max_tokens_per_step"] == 64
    assert composed["custom_envs"]["FrozenLake"]["env_config"]["is_slippery"] is False


def test_defaults_packages_self_order_groups_and_overrides(tmp_path):
    _write(tmp_path, {
        "shared/common.yaml": """\
            defaults:
              - more@_here_
            a: 1
            b: {x: 1, y: 2}
            """,
        "shared/more.yaml": "a: 0\nc: from_more\n",
        "run/env/small.yaml": "size: 2\n",
        "run/env/big.yaml": "size: 9\n",
        "run/main.yaml": """\
            defaults:
              - _self_
              - ../shared/common@_here_
              - env: small
              - override env: big
              - optional nothing: here
              - ../shared/more@placed.under
            a: 5
            b: {y: 7}
            """,
    })
    path = str(tmp_path / "run" / "main.yaml")
    out = hydra_compose.compose(read_yaml(path)[0], path)
    # _self_ first: the composed files win over the primary file's own a and b.y
    assert out["a"] == 1 and out["b"] == {"x": 1, "y": 2} and out["c"] == "from_more"
    assert out["env"] == {"size": 9}  # group env, option overridden to big, placed under the group's name
    assert out["placed"]["under"] == {"a": 0, "c": "from_more"}
    # default order (no _self_): the primary file's own keys win
    (tmp_path / "run" / "last.yaml").write_text("defaults:\n  - ../shared/common@_here_\na: 5\n")
    last = str(tmp_path / "run" / "last.yaml")
    assert hydra_compose.compose(read_yaml(last)[0], last)["a"] == 5


def test_defaults_errors_name_the_file(tmp_path):
    _write(tmp_path, {"a.yaml": "defaults:\n  - b@_here_\n", "b.yaml": "defaults:\n  - a@_here_\n",
                      "missing.yaml": "defaults:\n  - ../config/gone@_here_\n",
                      "up.yaml": "defaults:\n  - ../config/gone\n"})
    for name, pattern in [("missing.yaml", r"missing\.yaml: defaults entry names .*config/gone\.yaml, which does not"),
                          ("a.yaml", r"include each other: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"),
                          ("up.yaml", r"up\.yaml: defaults entry '\.\./config/gone' goes above its directory")]:
        path = str(tmp_path / name)
        with pytest.raises((ValueError, FileNotFoundError), match=pattern):
            load_yaml(path, fmt="roll")


def test_roll_file_composed_from_parts_maps_references_across_them(tmp_path):
    _write(tmp_path, {
        "config/common.yaml": "response_length: 8\nnorm_mean_type: group\nmax_steps: ${save_steps}\n",
        "exp/run.yaml": "defaults:\n  - ../config/common@_here_\nrollout_batch_size: 4\nadv_estimator: grpo\n"
                        "save_steps: 3\n",
    })
    cfg = load_yaml(str(tmp_path / "exp" / "run.yaml"), fmt="roll")
    assert cfg.trainer.total_training_steps == 3 and cfg.data.max_response_length == 8


def test_system_envs_become_the_runs_environment_and_must_agree_between_workers():
    text = BASE + "system_envs:\n  USE_MODELSCOPE: '1'\n  N: 3\nactor_train:\n  system_envs:\n    N: '3'\n    X: a\n"
    assert dict(load_yaml(text).trainer.env_vars) == {"USE_MODELSCOPE": "1", "N": "3", "X": "a"}
    with pytest.raises(ValueError, match=r"reference\.system_envs\.N='4' but system_envs\.N='3'.*one value"):
        load_yaml(BASE + "system_envs:\n  N: 3\nreference:\n  system_envs:\n    N: 4\n")


def test_env_vars_set_in_process_refuse_a_variable_read_already(monkeypatch):
    import jax  # noqa: F401  (imported: its JAX_* flags are read)

    monkeypatch.delenv("RLHF_JAX_TEST_ENV", raising=False)
    monkeypatch.delenv(process_env.RESTARTED, raising=False)
    with pytest.raises(ValueError, match=r"trainer\.env_vars\.JAX_LOG_COMPILES: .*read by JAX when it was imported"):
        process_env.apply({"JAX_LOG_COMPILES": "1"}, command=None)
    process_env.apply({"RLHF_JAX_TEST_ENV": "yes"}, command=None)
    assert os.environ["RLHF_JAX_TEST_ENV"] == "yes"


def test_roll_file_system_envs_reach_jax_before_it_reads_them(tmp_path):
    """A JAX flag read at import (JAX_LOG_COMPILES) set by the composed part's system_envs: the run logs its
    compilations, which it can only do if the variable was there before JAX was imported."""
    _write(tmp_path, {
        "config/envs.yaml": "system_envs:\n  JAX_LOG_COMPILES: '1'\n  ROLL_RUN_NAME: ${exp_name}\n",
        "exp/run.yaml": "defaults:\n  - ../config/envs@_here_\n  - _self_\nexp_name: composed\n" + BASE,
    })
    out = str(tmp_path / "out")
    overrides = {
        "actor_rollout_ref.model.path": "builtin:tiny",
        "data.train_files": "builtin:arithmetic?max_value=4&train_size=16",
        "data.val_files": "builtin:arithmetic?max_value=4&test_size=4", "data.prompt_key": "prompt",
        "data.max_prompt_length": 48, "data.max_response_length": 4, "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "trainer.total_training_steps": 2,
        "trainer.default_local_dir": out, "trainer.test_freq": 0, "trainer.val_before_train": False,
    }
    args = [f"--config={tmp_path / 'exp' / 'run.yaml'}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
    proc = run_main(args, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "environment of the run (trainer.env_vars): JAX_LOG_COMPILES=1, ROLL_RUN_NAME=composed" in proc.stderr
    assert "Compiling " in proc.stderr and "step 2" in proc.stdout
