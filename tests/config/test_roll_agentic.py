"""ROLL's agentic example files (tests/config/dialects/roll/examples/qwen2.5-0.5B-agentic/, unedited) read onto the
multi-turn environment keys, train two steps with shrinking overrides only, and convert to the same settings."""

import os
import shutil

import pytest

from rlhf_jax.config.yaml_import import load_yaml

EXAMPLES = os.path.join(os.path.dirname(__file__), "dialects", "roll", "examples")
FILES = {"frozen_lake": os.path.join(EXAMPLES, "qwen2.5-0.5B-agentic", "agent_val_frozen_lake.yaml"),
         "sokoban": os.path.join(EXAMPLES, "qwen2.5-0.5B-agentic", "agentic_val_sokoban.yaml")}


def _copy(tmp_path, name):
    """A copy of the example beside a copy of the traj_envs.yaml it composes (for tests that edit it)."""
    shutil.copytree(os.path.join(EXAMPLES, "config"), tmp_path / "config", dirs_exist_ok=True)
    (tmp_path / "agentic").mkdir(exist_ok=True)
    out = tmp_path / "agentic" / os.path.basename(FILES[name])
    shutil.copy(FILES[name], out)
    return str(out)


def test_frozen_lake_file_maps_onto_environment_rollouts():
    cfg = load_yaml(FILES["frozen_lake"])
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
    # grpo with traj_group_id mean_std: ROLL's grpo, the return of the group-normalised scores; then its
    # whitening and advantage clip
    alg = cfg.algorithm
    assert (alg.adv_estimator, alg.reward_norm.mean, alg.reward_norm.std) == ("reinforce", "group", "group")
    assert alg.whiten_advantages and alg.advantage_clip == 0.2
    assert arr.actor.ppo_mini_batch_size == 128  # 2 x 64 x 8 devices = 1024 episodes = 128 groups


def test_sokoban_file_validates_with_actor_infers_sampling():
    cfg = load_yaml(FILES["sokoban"])
    arr = cfg.actor_rollout_ref
    assert cfg.data.train_files == ("builtin:env_tasks?env=SimpleSokoban&train_size=131072",)
    sokoban = arr.rollout.multi_turn.environments["SimpleSokoban"]
    game = sokoban["env_config"]
    assert (sokoban["environment"], list(game["dim_room"]), game["num_boxes"]) == ("sokoban", [6, 6], 1)
    v = arr.rollout.val_kwargs
    assert (v.do_sample, v.temperature, v.top_p, v.top_k) == (True, 0.99, 0.99, 100)


def test_a_tag_no_custom_env_defines_is_named(tmp_path):
    path = _copy(tmp_path, "sokoban")
    with open(path) as f:
        text = f.read().replace("tags: [SimpleSokoban]", "tags: [Maze]")
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match="plays tag 'Maze', which custom_envs does not define"):
        load_yaml(path)


# Shrinking overrides (our keys): a tiny model with room for ROLL's ~900-token first prompt, a few short episodes,
# two steps, one device, no validation before training (the file validates 1024 episodes), 8 boards to train on
# (the file's 131072 take ten seconds to render and tokenize).
def _shrunk(out: str, model_dir: str, tag: str) -> dict:
    return {"actor_rollout_ref.model.path": model_dir, "data.train_batch_size": 2, "data.val_batch_size": 4,
            "data.train_files": f"builtin:env_tasks?env={tag}&train_size=8",
            "data.val_max_samples": 4,
            "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 2,
            "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": 4, "data.max_prompt_length": 1536,
            "data.max_response_length": 64, "trainer.total_training_steps": 2, "trainer.val_before_train": False,
            "trainer.n_gpus_per_node": 1, "trainer.default_local_dir": out, "trainer.log_dir": out,
            "trainer.logger": "['console','jsonl']"}


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    from tests.train.helpers import tiny_hf_checkpoint

    return tiny_hf_checkpoint("LlamaConfig", "LlamaForCausalLM", str(tmp_path_factory.mktemp("tiny2k")),
                              max_position_embeddings=2048)


@pytest.mark.parametrize("name", sorted(FILES))
def test_agentic_file_trains_two_steps_and_its_conversion_reads_the_same(name, long_tiny, tmp_path):
    from rlhf_jax.config.__main__ import convert
    from tests.config import trinity_runs as R

    out = str(tmp_path / "file")
    overrides = _shrunk(out, long_tiny, "FrozenLake" if name == "frozen_lake" else "SimpleSokoban")
    R.ran_two_steps(R.run_file(FILES[name], overrides), out, "roll")
    converted = tmp_path / "converted.yaml"
    converted.write_text(convert(FILES[name]))
    R.assert_same_settings(FILES[name], str(converted), overrides)
