"""ROLL's agentic example files (tests/config/dialects/roll/examples/qwen2.5-0.5B-agentic/, unedited) read onto the
multi-turn environment keys."""

import os
import shutil

import pytest

from rlhf_jax.config.yaml_import import load_yaml

EXAMPLES = os.path.join(os.path.dirname(__file__), "dialects", "roll", "examples")
FILES = {"frozen_lake": os.path.join(EXAMPLES, "qwen2.5-0.5B-agentic", "agent_val_frozen_lake.yaml"),
         "sokoban": os.path.join(EXAMPLES, "qwen2.5-0.5B-agentic", "agentic_val_sokoban.yaml")}
# what ROLL's RLVR estimator keys must map before these files run unedited (config/dialects/roll.py)
ESTIMATOR_KEYS = ("advantage_clip", "whiten_advantages")


def _without_estimator_keys(tmp_path, name):
    """The example without advantage_clip / whiten_advantages, beside a copy of the traj_envs.yaml it composes."""
    shutil.copytree(os.path.join(EXAMPLES, "config"), tmp_path / "config", dirs_exist_ok=True)
    (tmp_path / "agentic").mkdir(exist_ok=True)
    out = tmp_path / "agentic" / os.path.basename(FILES[name])
    with open(FILES[name]) as f:
        out.write_text("".join(line for line in f if not line.startswith(ESTIMATOR_KEYS)))
    return str(out)


@pytest.mark.parametrize("name", sorted(FILES))
def test_unedited_agentic_files_stop_only_at_the_estimator_keys(name):
    with pytest.raises(ValueError, match=r"advantage_clip=0\.2 is not supported"):
        load_yaml(FILES[name])


def test_frozen_lake_file_maps_onto_environment_rollouts(tmp_path):
    cfg = load_yaml(_without_estimator_keys(tmp_path, "frozen_lake"))
    arr, d = cfg.actor_rollout_ref, cfg.data
    mt = arr.rollout.multi_turn
    assert mt.enable and sorted(mt.environments) == ["FrozenLake", "LargerSokoban", "SimpleSokoban",
                                                      "SokobanDifferentGridVocab"]
    lake = mt.environments["FrozenLake"]
    assert (lake["environment"], lake["max_steps"], lake["max_tokens_per_step"]) == ("frozen_lake", 10, 64)
    assert (lake["env_config"]["is_slippery"], lake["env_config"]["format_penalty"]) == (False, -0.01)
    assert mt.environments["SokobanDifferentGridVocab"]["env_config"]["grid_vocab"][1] == [".", "empty"]
    # 1024 episodes a step in groups of 8 on one board: 128 boards; a fresh board per group and step
    assert (d.train_batch_size, arr.rollout.n) == (128, 8)
    assert d.train_files == ("builtin:env_tasks?env=FrozenLake&train_size=131072",)
    assert d.val_files == tuple(f"builtin:env_tasks?env={t}&test_size=256" for t in
                                ("SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab", "FrozenLake"))
    assert (d.val_batch_size, arr.rollout.val_kwargs.n) == (1024, 1)
    assert (mt.max_assistant_turns, mt.max_tokens_per_turn) == (10, 64)  # max_tokens_per_step 64 < max_new_tokens
    # actor_infer has no generating_args: the train manager's sample, the val manager's validate
    assert (arr.rollout.temperature, arr.rollout.top_p, arr.rollout.top_k) == (0.99, 0.99, 100)
    assert arr.rollout.val_kwargs.do_sample and arr.rollout.val_kwargs.temperature == 0.2
    assert d.system_prompt.startswith("You're a helpful assistant. You are a good game player.")
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo  # traj_group_id mean_std
    assert arr.actor.ppo_mini_batch_size == 128  # 2 x 64 x 8 devices = 1024 episodes = 128 groups


def test_sokoban_file_validates_with_actor_infers_sampling(tmp_path):
    cfg = load_yaml(_without_estimator_keys(tmp_path, "sokoban"))
    arr = cfg.actor_rollout_ref
    assert cfg.data.train_files == ("builtin:env_tasks?env=SimpleSokoban&train_size=131072",)
    sokoban = arr.rollout.multi_turn.environments["SimpleSokoban"]
    game = sokoban["env_config"]
    assert (sokoban["environment"], list(game["dim_room"]), game["num_boxes"]) == ("sokoban", [6, 6], 1)
    v = arr.rollout.val_kwargs
    assert (v.do_sample, v.temperature, v.top_p, v.top_k) == (True, 0.99, 0.99, 100)


def test_a_tag_no_custom_env_defines_is_named(tmp_path):
    path = _without_estimator_keys(tmp_path, "sokoban")
    with open(path) as f:
        text = f.read().replace("tags: [SimpleSokoban]", "tags: [Maze]")
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match="plays tag 'Maze', which custom_envs does not define"):
        load_yaml(path)
