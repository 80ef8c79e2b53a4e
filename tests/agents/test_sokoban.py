"""Sokoban: ROLL's rooms from a seed, pushing rules, rewards, invalid actions and success."""

from __future__ import annotations

import numpy as np

from rlhf_jax.agents.environment import load_environment
from rlhf_jax.agents.sokoban import Sokoban, make_room

ENTRY = {"max_steps": 10, "env_config": {"dim_room": [6, 6], "num_boxes": 1, "max_steps": 10,
                                          "format_penalty": -0.15}}
# ROLL's generate_room(dim=(6, 6), num_steps=20, num_boxes=1, search_depth=300) after all_seed(7)
FIXED = [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 2, 0], [0, 0, 0, 1, 1, 0],
         [0, 0, 0, 0, 0, 0]]
STATE = [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 5, 4, 1, 0], [0, 0, 0, 1, 2, 0], [0, 0, 0, 1, 1, 0],
         [0, 0, 0, 0, 0, 0]]


def _game(entry=ENTRY) -> Sokoban:
    env = Sokoban()
    env.reset({"seed": 7, "env_config": entry})
    return env


def test_seeded_room_is_rolls():
    fixed, state = make_room(7, (6, 6), 1, 300)
    assert fixed.tolist() == FIXED and state.tolist() == STATE
    assert _game().render() == "######\n##___#\n##PX_#\n###_O#\n###__#\n######"


def test_push_onto_target_wins():
    env = _game()
    results = [env.step(f"<answer>{a}</answer>") for a in ("Right", "Up", "Right", "Down")]
    assert [round(r.reward, 6) for r in results] == [-0.1, -0.1, -0.1, 10.9]  # step, step, step, +1 +10
    assert [r.done for r in results] == [False, False, False, True]
    assert results[-1].info["success"] and "√" in results[-1].observation


def test_push_off_target_costs_one():
    env = _game()
    env.set_board(FIXED, [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 5, 0], [0, 0, 0, 1, 3, 0],
                          [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    off = env.step("<answer>Down</answer>")
    assert round(off.reward, 6) == -1.1 and not off.done and "S" in off.observation  # the player on the target


def test_walls_and_boxes_block():
    env = _game()
    wall = env.step("<answer>Left</answer>")  # (2, 1) is a wall
    assert not wall.info["action_is_effective"] and round(wall.reward, 6) == -0.1
    env.set_board(FIXED, [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 5, 4, 4, 0], [0, 0, 0, 1, 2, 0],
                          [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    assert not env.step("<answer>Right</answer>").info["action_is_effective"]  # a box behind the box


def test_invalid_action_is_a_step_with_the_format_penalty():
    env = _game()
    before = env.render()
    bad = env.step("<answer>north</answer>")
    assert round(bad.reward, 6) == round(-0.1 - 0.15, 6) and not bad.info["action_is_valid"]
    assert env.render() == before and "You have 9 actions left." in bad.observation


def test_game_ends_after_its_max_steps():
    env = _game({**ENTRY, "env_config": {**ENTRY["env_config"], "max_steps": 2}})
    assert [env.step("<answer>Left</answer>").done for _ in range(2)] == [False, True]


def test_rolls_tags_are_registered_with_their_rooms():
    small = load_environment("SimpleSokoban")()
    small.reset({"seed": 3})
    assert small.state.shape == (6, 6) and np.sum(small.state == 4) + np.sum(small.state == 3) == 1
    large = load_environment("LargerSokoban")()
    large.reset({"seed": 3})
    assert large.state.shape == (10, 10) and np.sum((large.state == 4) | (large.state == 3)) == 2
    vocab = load_environment("SokobanDifferentGridVocab")()
    text = vocab.reset({"seed": 3})
    assert "W: wall, .: empty, G: target" in text and set(vocab.render()) <= set("W.GCBA@\n")
