"""GRPO with multi-turn tool-calling rollouts: a trainer run whose batches have tool responses (loss-mask holes),
the CLI with the calculator tool, and bad settings stopped by name before anything compiles."""

from __future__ import annotations

import math

import pytest

from rlhf_jax.agents import Tool, register_tool
from rlhf_jax.agents.environment import Environment, StepResult, register_environment
from rlhf_jax.agents.tool_calls import ParsedCalls, ToolCall, register_parser
from rlhf_jax.config import finalize
from rlhf_jax.train.setup import tool_schemas
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import cli_args, make_config, read_metrics, run_main

MT = "actor_rollout_ref.rollout.multi_turn."
ONE_DEVICE = {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}
TURNS = {MT + "enable": True, MT + "tools": ("calculator",), MT + "max_assistant_turns": 3,
         MT + "max_tokens_per_turn": 6, "data.max_response_length": 80, "data.prompt_template": "native",
         "data.max_prompt_length": 32}


@register_parser("test_first_two_turns")
def _calls_in_short_texts(text: str) -> ParsedCalls:
    """A call to ``test_digits`` after every turn: the random tiny model never writes one itself."""
    return ParsedCalls((ToolCall("test_digits", {"text": text}),), ())


register_tool(Tool("test_digits", "count characters", {"type": "object"}, lambda text: str(len(text))))


@register_environment("test_echo")
class _Echo(Environment):
    """Two moves; each scores the task's number plus the move's length, so any text earns a reward that differs
    between tasks and between moves of different lengths (a random model's greedy moves are all alike)."""

    def reset(self, task: dict) -> str:
        self.moves, self.number = 0, int(task["ground_truth"])
        return f"Say {self.number} at length."

    def step(self, action: str) -> StepResult:
        self.moves += 1
        return StepResult("Again.", (self.number + len(action)) / 10, self.moves >= 2)


def test_grpo_trains_on_multi_turn_rollouts_with_tool_tokens_masked_and_dynamic_sampling(tmp_path):
    """Multi-turn rollouts with DAPO's dynamic sampling: further prompt batches are drawn until the groups vary,
    and the kept rows keep their tool tokens masked."""
    from tests.train.test_verl_semantics import HALF_FLAT_REWARD

    reward = tmp_path / "reward.py"
    reward.write_text(HALF_FLAT_REWARD)
    cfg = make_config(str(tmp_path), "grpo", **{**TURNS, MT + "tools": ("test_digits",),
                                                MT + "format": "test_first_two_turns",
                                                "algorithm.filter_groups.enable": True,
                                                "algorithm.filter_groups.metric": "acc",
                                                "custom_reward_function.path": str(reward)})
    trainer = Trainer(cfg)
    trainer.fit()
    rows = read_metrics(str(tmp_path))
    assert all(r["train/num_gen_batches"] >= 2 for r in rows)  # half the groups are flat: one batch never fills
    last = rows[-1]
    assert last["multi_turn/num_turns/max"] == 3 and last["multi_turn/tool_calls/mean"] >= 1
    assert 0 < last["multi_turn/masked_token_fraction"] < 1
    assert last["multi_turn/tool_errors/max"] == 0 and last["multi_turn/tool_timeouts/max"] == 0
    assert last["multi_turn/device_idle_s"] >= 0 and 0 <= last["multi_turn/device_idle_fraction"] <= 1
    for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        assert math.isfinite(last[k]), k
    # the trained tokens are the assistant turns only: at most 3 turns x 6 tokens
    assert last["response_length/max"] <= 18
    sampler = next(iter(trainer.rollouts.multi_turn._samplers.values()))
    assert sampler.decoded_tokens > 0 and sampler.prefilled_tokens > 0


def test_multi_turn_rollouts_on_rollout_devices_train_like_the_shared_layout(tmp_path):
    """The conversations are sampled on 4 devices of their own from the trained weights' copy; the batch trains on
    the other 4, as the 8 shared devices train it."""
    turns = {**TURNS, MT + "tools": ("test_digits",), MT + "format": "test_first_two_turns"}
    runs = {}
    for name, extra in (("shared", {}), ("split", {"mesh.rollout_devices": 4, "mesh.tensor": 1})):
        trainer = Trainer(make_config(str(tmp_path / name), "grpo", **turns, **extra))
        trainer.fit()
        if extra:
            sampler = next(iter(trainer.rollouts.multi_turn._samplers.values()))
            assert sampler.decoded_tokens > 0 and set(sampler.mesh.devices.flat) == set(
                trainer.c.rollout_mesh.devices.flat)
        trainer.close()
        runs[name] = read_metrics(str(tmp_path / name))
    a, b = runs["shared"], runs["split"]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        assert rb["multi_turn/tool_calls/mean"] >= 1 and 0 < rb["multi_turn/masked_token_fraction"] < 1
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean",
                    "multi_turn/num_turns/mean", "multi_turn/masked_token_fraction"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), (ra["step"], key)


def test_cli_grpo_with_the_calculator_tool(tmp_path):
    out = str(tmp_path / "run")
    proc = run_main(cli_args(out, **{**TURNS, **ONE_DEVICE}), devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows][-1] == 2
    for name in ("num_turns/mean", "num_turns/max", "tool_calls/mean", "tool_calls/max", "tool_errors/mean",
                 "tool_errors/max", "tool_timeouts/mean", "tool_timeouts/max", "tool_latency_s",
                 "masked_token_fraction", "device_idle_s", "device_idle_fraction"):
        assert f"multi_turn/{name}" in rows[-1], name


GAME = {**TURNS, MT + "tools": (), MT + "environment": "guess_number", "data.max_prompt_length": 160,
        "data.train_files": ("builtin:guess_number?max_value=3&max_steps=3&train_size=16",),
        "data.val_files": ("builtin:guess_number?max_value=3&max_steps=3&test_size=4",)}


def test_grpo_with_an_environment_scores_by_its_rewards(tmp_path):
    """The guessing game: its first observation is the prompt, its per-turn rewards summed are the score."""
    cfg = make_config(str(tmp_path), "grpo", **GAME)
    trainer = Trainer(cfg)
    trainer.fit()
    for row in read_metrics(str(tmp_path))[1:]:
        assert row["critic/score/mean"] == pytest.approx(row["multi_turn/env_reward/mean"])
        assert row["multi_turn/num_turns/mean"] >= 1 and row["multi_turn/tool_calls/max"] == 0
        assert math.isfinite(row["actor/pg_loss"])


@pytest.mark.parametrize("per_turn", [False, True])
def test_remax_baselines_each_prompt_with_one_greedy_episode_of_its_game(tmp_path, per_turn):
    """ReMax with an environment: a prompt's baseline is the score of one greedy episode of the same game, played
    as the samples are. Sampled greedily, the samples are that episode: every row's baseline is its own score (a
    single-turn response, or the reward function's score, would not be). Then the run trains on reward-to-go
    minus the baseline; with per-turn rewards the baseline is the episode's whole score."""
    import dataclasses

    import numpy as np

    from rlhf_jax.parallel.hosts import to_local

    cfg = make_config(str(tmp_path), "grpo", **{**GAME, MT + "environment": "test_echo",
                                                "algorithm.adv_estimator": "remax", MT + "per_turn_rewards": per_turn})
    trainer = Trainer(cfg)
    try:
        greedy = dataclasses.replace(trainer.producer, sampling=dataclasses.replace(trainer.producer.sampling,
                                                                                    do_sample=False))
        scored = greedy.produce(next(trainer.loader), 0)
        scores, baselines = to_local(scored.scores), to_local(scored.baselines)
        totals = scores.sum(-1) if per_turn else scores  # (N, R) per-turn rewards on the turns' last tokens
        np.testing.assert_array_equal(baselines, totals)
        assert len(set(totals.tolist())) > 1, totals  # each prompt's own game: the baselines differ
        trainer.fit()
    finally:
        trainer.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["timing_s/gen_max"] > 0 and r["multi_turn/num_turns/mean"] >= 1
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"])
    assert any(r["critic/advantages/max"] != r["critic/advantages/min"] for r in rows)


AGENT = '''
import json

from rlhf_jax.agents.tools import calculate


def solve(client, task):
    """Ask, run the calculator when called, otherwise ask to check; reward: the answer appears."""
    messages = [{"role": "user", "content": str(task["prompt"])}]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    for _ in range(task["workflow_args"]["calls"]):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        message = reply.choices[0].message
        messages.append({"role": "assistant", "content": message.content})
        for call in message.tool_calls or []:
            try:
                result = calculate(**json.loads(call.function.arguments))
            except Exception as e:
                result = f"Error: {e}"
            messages.append({"role": "tool", "content": result, "tool_call_id": call.id})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Again."})
    return float(str(task["ground_truth"]) in messages[-2]["content"])
'''


def test_grpo_trains_a_workflow_agent_written_against_the_openai_client(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    cfg = make_config(str(tmp_path / "run"), "grpo", **{**TURNS, MT + "tools": (), MT + "workflow": f"{path}:solve",
                                                         MT + "workflow_args": {"calls": 2},
                                                         "data.max_response_length": 200, "data.max_prompt_length": 64})
    trainer = Trainer(cfg)
    trainer.fit()
    rows = read_metrics(str(tmp_path / "run"))
    for row in rows[1:]:
        assert row["critic/score/mean"] == pytest.approx(row["multi_turn/env_reward/mean"])
        assert row["multi_turn/num_turns/mean"] == 2  # workflow_args: two client calls per episode
        assert row["multi_turn/calls_per_batch"] >= 1  # the clients' calls sampled together (see test_client.py)
        assert 0 < row["multi_turn/masked_token_fraction"] < 1  # the agent's own messages are not trained
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
    sampler = next(iter(trainer.rollouts.multi_turn._samplers.values()))
    assert sampler.decoded_tokens > 0


@pytest.mark.parametrize("overrides, message", [
    ({MT + "workflow": "/no/such/agent.py:solve"}, "multi_turn.workflow: file not found"),
    ({MT + "workflow": "solve"}, "multi_turn.workflow='solve' is not a registered workflow"),
    ({MT + "environment": "/no/such/envs.py:Maze"}, "multi_turn.environment: file not found"),
    ({MT + "environment": "maze"}, "multi_turn.environment='maze' is not a registered environment"),
    ({MT + "tools": ("calculator", "no_such_tool")}, "multi_turn.tools names tool 'no_such_tool', which is not "
                                                     "registered"),
    ({MT + "max_assistant_turns": 0}, "multi_turn.max_assistant_turns=0 must be >= 1"),
    ({MT + "tools": ()}, "multi_turn.enable=True needs tools"),
    ({MT + "workflow_args": {"calls": 2}}, "multi_turn.workflow_args is set but actor_rollout_ref.rollout.multi_turn."
                                           "workflow is not"),
    ({MT + "format": "xml"}, "multi_turn.format='xml' is not a registered tool-call parser"),
])
def test_bad_multi_turn_settings_stop_before_any_model_by_name(tmp_path, overrides, message):
    """finalize checks the values; the names a user's file may register are looked up when the run is prepared."""
    cfg = make_config(str(tmp_path), "grpo", **{**TURNS, **overrides})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tool_schemas(finalize(cfg, num_devices=8))


def test_tool_config_file_naming_a_missing_tool_is_one_line_from_the_cli(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: x.Calc\n    config: {type: native}\n    tool_schema:\n      type: function\n"
                    "      function: {name: abacus, description: d, parameters: {type: object}}\n")
    proc = run_main(cli_args(str(tmp_path / "run"), **{**TURNS, **ONE_DEVICE, MT + "tools": (),
                                                       MT + "tool_config_path": str(path)}), devices=1)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "multi_turn.tool_config_path" in lines[0] and "'abacus'" in lines[0], proc.stderr
