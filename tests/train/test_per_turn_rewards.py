"""multi_turn.per_turn_rewards: an environment's reward for each turn sits on the last trained token of that turn
(token-level rewards), rows sum to the trajectory's total, outcome estimators (GRPO) see only the sum, and GAE
credits each turn with the rewards from it on (float64 NumPy reference); a trainer step carries the grid."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.agents.environment import Environment, StepResult, register_environment
from rlhf_jax.agents.turns import Trajectory
from rlhf_jax.config import finalize
from rlhf_jax.rewards import place_on_last_token
from rlhf_jax.train import metrics as M
from rlhf_jax.agents.multi_turn import per_turn_rewards
from rlhf_jax.train.steps import advantage_stage
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config

MT = "actor_rollout_ref.rollout.multi_turn."


def _trajectory(turns: list[tuple[int, int, float]]) -> Trajectory:
    """Assistant turns of ``a`` sampled tokens, each answered by ``b`` environment tokens and a reward."""
    t = Trajectory(prompt_ids=[1])
    for sampled, reply, reward in turns:
        t.extend([5] * sampled, True)
        t.turn_rewards.append(reward)
        t.reward_ends.append(len(t.response_ids) - 1)
        t.extend([7] * reply, False)
    return t


def test_each_reward_sits_on_the_last_trained_token_of_its_turn():
    rng = np.random.default_rng(0)
    r = rng.normal(size=6)
    trajs = [_trajectory([(3, 2, r[0]), (2, 1, r[1]), (2, 0, r[2])]),  # 3 turns, all inside the grid
             _trajectory([(2, 1, r[3]), (0, 2, r[4])]),  # an empty turn: its reward joins the previous turn's token
             _trajectory([(4, 3, r[5]), (6, 0, 0.7)])]  # the second turn runs past the grid: cut at width 10
    grid = per_turn_rewards(trajs, 10)
    want = np.zeros((3, 10), np.float32)
    want[0, [2, 6, 9]] = r[:3]
    want[1, 1] = r[3] + r[4]
    want[2, [3, 9]] = [r[5], 0.7]
    np.testing.assert_allclose(grid, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(grid.sum(-1), [r[:3].sum(), r[3] + r[4], r[5] + 0.7], atol=1e-6)


def _stage(token_scores, mask, values, estimator):
    groups = jnp.asarray([0, 0, 1, 1], jnp.int32)
    return advantage_stage(jnp.asarray(token_scores), jnp.asarray(mask), groups, None, None, values, 0.0,
                           estimator=estimator, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
                           use_kl_in_reward=False, kl_penalty="kl")


def test_grpo_sees_the_sum_and_gae_credits_each_turn_with_the_rewards_from_it_on():
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(4, 3))
    trajs = [_trajectory([(3, 2, rewards[i, 0]), (2, 2, rewards[i, 1]), (3, 0, rewards[i, 2])]) for i in range(4)]
    width = len(trajs[0].response_ids)
    mask = np.asarray([t.loss_mask for t in trajs], np.float32)
    grid = per_turn_rewards(trajs, width)
    summed = place_on_last_token(jnp.asarray(grid.sum(-1)), jnp.asarray(mask))
    _, adv_turns, _, _ = _stage(grid, mask, None, "grpo")
    _, adv_sum, _, _ = _stage(summed, mask, None, "grpo")
    np.testing.assert_allclose(np.asarray(adv_turns), np.asarray(adv_sum), atol=1e-6)
    # GAE with gamma = lam = 1 and zero values: a token's return is the sum of the rewards of its turn and after
    _, _, returns, _ = _stage(grid, mask, jnp.zeros_like(jnp.asarray(mask)), "gae")
    turn_of = np.cumsum(np.r_[0, (mask[0, 1:] == 1) & (mask[0, :-1] == 0)])  # turn index of every position
    want = np.stack([[rewards[i, k:].sum() if mask[i, t] else 0.0 for t, k in enumerate(turn_of)]
                     for i in range(4)]).astype(np.float64)
    np.testing.assert_allclose(np.asarray(returns) * mask, want, atol=1e-5)


@register_environment("test_counting")
class Counting(Environment):
    """Three moves; move k (1-based) earns 0.5 k whatever the model says."""

    def reset(self, task: dict) -> str:
        self.moves = 0
        return "Say anything, three times."

    def step(self, action: str) -> StepResult:
        self.moves += 1
        return StepResult("Again.", 0.5 * self.moves, self.moves >= 3, {})


def test_a_trainer_step_trains_on_the_per_turn_grid(tmp_path):
    cfg = make_config(str(tmp_path), "grpo", **{
        MT + "enable": True, MT + "environment": "test_counting", MT + "per_turn_rewards": True,
        MT + "max_assistant_turns": 3, MT + "max_tokens_per_turn": 6, "data.max_response_length": 80,
        "data.prompt_template": "native", "data.max_prompt_length": 160,
        "data.train_files": ("builtin:guess_number?max_value=3&max_steps=3&train_size=16",),
        "data.val_files": ("builtin:guess_number?max_value=3&max_steps=3&test_size=4",)})
    trainer = Trainer(cfg)
    experience = trainer.producer.produce(next(trainer.loader), 0)
    grid = np.asarray(experience.scores)
    mask = np.asarray(experience.rollout.response_mask)
    assert grid.shape == mask.shape
    np.testing.assert_allclose(grid.sum(-1), 3.0, atol=1e-6)  # 0.5 + 1.0 + 1.5 on every row
    for row, m in zip(grid, mask):
        ends = [t for t in range(len(m)) if m[t] and (t + 1 == len(m) or not m[t + 1])]  # last token of each turn
        np.testing.assert_allclose(row[ends], [0.5, 1.0, 1.5], atol=1e-6)
    metrics = trainer.learn(experience, M.Timer(), step=0)
    assert metrics["critic/score/mean"] == pytest.approx(3.0)
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
    trainer.close()


def test_per_turn_rewards_without_an_environment_is_refused_by_name(tmp_path):
    cfg = make_config(str(tmp_path), "grpo", **{MT + "enable": True, MT + "tools": ("calculator",),
                                                MT + "per_turn_rewards": True})
    with pytest.raises(ValueError, match=r"multi_turn\.per_turn_rewards=True needs an environment"):
        finalize(cfg, num_devices=8)
