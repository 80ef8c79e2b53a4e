"""FrozenLake: ROLL's maps from a seed, its text grid, its actions, rewards and endings; the prompt protocol."""

from __future__ import annotations

import pytest

from rlhf_jax.agents.environment import load_environment
from rlhf_jax.agents.frozen_lake import FrozenLake, random_map
from rlhf_jax.agents.text_games import parse_action

KNOWN = ["SFFF", "FHFH", "FFFH", "HFFG"]
ENTRY = {"max_steps": 10, "max_tokens_per_step": 64, "env_config": {"is_slippery": False, "max_steps": 10,
                                                                     "format_penalty": -0.01}}


def _game(desc=KNOWN, entry=ENTRY) -> FrozenLake:
    env = FrozenLake()
    env.reset({"seed": 0, "env_config": entry})
    env.set_map(desc)
    return env


def test_seeded_map_is_rolls():
    # ROLL's generate_random_map(size=4, p=0.8, seed=42) (roll/pipeline/agentic/env/frozen_lake/utils.py)
    assert random_map(4, 0.8, 42) == ["FFSF", "FHFF", "FFFH", "GHFF"]
    assert random_map(4, 0.8, 42) == random_map(4, 0.8, 42) != random_map(4, 0.8, 43)


def test_first_observation_is_instructions_then_turn_template():
    env = load_environment("FrozenLake")()
    text = env.reset({"seed": 42, "env_config": ENTRY})
    assert text.startswith("You are solving the FrozenLake puzzle.")
    assert "\nThe meaning of each symbol in the state is:\nP: player, _: empty, O: hole, G: goal" in text
    assert "\nYour available actions are:\nLeft, Down, Right, Up\nTurn 1:\nObservation:\n__P_\n_O__\n___O\nGO__\n" \
        in text
    assert "You have 10 actions left." in text and "Max response length: 64 words" in text


def test_hole_ends_with_zero_and_goal_with_one():
    env = _game()
    assert env.step("<answer>Down</answer>").reward == 0.0
    fell = env.step("<answer>Right</answer>")  # (1, 1) is a hole
    assert (fell.reward, fell.done, fell.info["success"]) == (0.0, True, False)
    assert "_X_" in fell.observation.split("Observation:\n")[1]
    env = _game()
    results = [env.step(f"<answer>{a}</answer>") for a in ("Down", "Down", "Right", "Right", "Down", "Right")]
    assert [r.reward for r in results] == [0, 0, 0, 0, 0, 1.0]
    assert [r.done for r in results] == [False] * 5 + [True]
    assert results[-1].info["success"] and "√" in results[-1].observation


def test_invalid_and_blocked_actions():
    env = _game()
    bad = env.step("I go up")
    assert (bad.reward, bad.done, bad.info["action_is_valid"]) == (-0.01, False, False)
    assert "You have 9 actions left." in bad.observation
    blocked = env.step("<answer>up</answer><|im_end|>")  # the edge: valid, no move; names compare without case
    assert blocked.info["action_is_valid"] and not blocked.info["action_is_effective"] and blocked.reward == 0.0


def test_episode_ends_after_max_steps_actions():
    env = _game(entry={**ENTRY, "max_steps": 3})
    assert [env.step("<answer>Left</answer>").done for _ in range(3)] == [False, False, True]


def test_slippery_moves_follow_the_seed():
    entry = {**ENTRY, "env_config": {**ENTRY["env_config"], "is_slippery": True}}
    runs = []
    for _ in range(2):
        env = FrozenLake()
        env.reset({"seed": 5, "env_config": entry})
        runs.append([env.render() for _ in range(6) if not env.step("<answer>Right</answer>").done])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("text,expected", [
    ("<answer>Right</answer>", (2, "Right")),
    ("<think>go</think> <answer> left </answer>", (0, "left")),
    ("<answer>Jump</answer>", (None, "Jump")),
    ("no tags", (None, "")),
])
def test_parse_action(text, expected):
    assert parse_action(text, r"<answer>(.*?)</answer>", FrozenLake.ACTIONS) == expected


def test_think_pattern_takes_the_second_group():
    pattern = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>"
    assert parse_action("<think>down is safe</think>\n<answer>Down</answer>", pattern, FrozenLake.ACTIONS) == \
        (1, "Down")
    assert parse_action("<answer>Down</answer>", pattern, FrozenLake.ACTIONS) == (None, "")


def test_unknown_setting_is_named():
    with pytest.raises(ValueError, match="no setting colour"):
        FrozenLake().reset({"seed": 0, "env_config": {"env_config": {"colour": "blue"}}})
