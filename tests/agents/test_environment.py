"""Environments: the built-in guessing game, loading by name or from a user's file, and environments driving the
multi-turn loop (observations as untrained user turns, rewards per turn, greedy turns == single generate calls)."""

from __future__ import annotations

import pytest

from rlhf_jax.agents.environment import (GuessNumber, environment_reply, load_environment, make_environments)
from rlhf_jax.agents.render import tool_suffix_ids
from rlhf_jax.agents.turns import TurnSettings, run_turns
from rlhf_jax.rollout import SamplingParams, generate, rollout_key
from rlhf_jax.rollout.conversation_sampler import ConversationSampler

from .test_turns import _runs, _state

USER_FILE = '''
from rlhf_jax.agents.environment import Environment, StepResult


class Countdown(Environment):
    """Three moves; the reward of move k is k / 10; the observation names the move."""

    def reset(self, task):
        self.moves = 0
        return f"Count with me from {task['start']}."

    def step(self, action):
        self.moves += 1
        return StepResult(f"move {self.moves} after {len(action)} characters", self.moves / 10, self.moves >= 3)
'''


def test_guess_number_needs_several_moves():
    env = GuessNumber()
    assert "between 1 and 20" in env.reset({"secret": 13, "low": 1, "high": 20, "max_moves": 4})
    first = env.step("I guess 10")
    assert (first.observation, first.reward, first.done, first.info) == ("Higher.", 0.0, False, {"moves": 1})
    assert env.step("17").observation == "Lower."
    assert env.step("no number here").observation == "Answer with one integer."
    last = env.step("then 13")  # the fourth move
    assert (last.observation, last.reward, last.done) == ("Correct!", 1.0, True)
    env.reset({"secret": 5, "max_moves": 2})
    assert env.step("50").observation == "Lower." and env.step("40").done


def test_environments_load_by_name_or_from_a_file(tmp_path):
    assert load_environment("guess_number") is GuessNumber
    path = tmp_path / "envs.py"
    path.write_text(USER_FILE)
    cls = load_environment(f"{path}:Countdown", key="multi_turn.environment")
    assert cls.__name__ == "Countdown" and cls().reset({"start": 3}) == "Count with me from 3."
    for spec, message in ((f"{path}:Missing", f"multi_turn.environment: {path} defines no 'Missing'"),
                          (f"{tmp_path}/nope.py:X", "multi_turn.environment: file not found"),
                          ("maze", "multi_turn.environment='maze' is not a registered environment")):
        with pytest.raises(ValueError) as err:
            load_environment(spec, key="multi_turn.environment")
        assert message in str(err.value) and "\n" not in str(err.value)


def test_an_environment_drives_the_turns(checkpoints, tmp_path):
    from transformers import AutoTokenizer

    from rlhf_jax.models import from_pretrained

    path = checkpoints["llama"]
    model = from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    eos = (tok.eos_token_id,)
    user_file = tmp_path / "envs.py"
    user_file.write_text(USER_FILE)
    envs, observations = make_environments(load_environment(f"{user_file}:Countdown"), [{"start": s} for s in range(3)])
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": o}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for o in observations]
    settings = TurnSettings(response_length=160, max_assistant_turns=5, max_tokens_per_turn=5)
    params = SamplingParams(max_new_tokens=5, temperature=0.0, eos_token_ids=eos, pad_token_id=tok.pad_token_id)
    sampler = ConversationSampler.for_model(model, capacity=max(map(len, prompts)) + 160, params=params, turn_len=5,
                                            stage=16)
    trajs, timings = run_turns(sampler, _state(model), tok, prompts, settings, rollout_key(0), eos,
                               replies=[environment_reply(e) for e in envs])
    observed = 0
    for prompt, traj in zip(prompts, trajs):
        assert traj.turns == 3 and traj.turn_rewards == [0.1, 0.2, 0.3]  # the game ends at its third move
        runs = _runs(traj.loss_mask)
        assert [v for _, _, v in runs] == [1, 0, 1, 0, 1]
        for k, (start, end, sampled) in enumerate(runs):
            piece = traj.response_ids[start:end]
            if sampled:
                ref = generate(model, [prompt + traj.response_ids[:start]], max_new_tokens=5, temperature=0.0,
                               eos_token_ids=eos, pad_token_id=tok.pad_token_id)
                assert piece == ref.tokens[0]
            else:
                action = tok.decode(traj.response_ids[runs[k - 1][0]:runs[k - 1][1]], skip_special_tokens=False)
                message = {"role": "user", "content": f"move {k // 2 + 1} after {len(action)} characters"}
                assert piece == tool_suffix_ids(tok, [message], traj.response_ids[start - 1] in eos)
                observed += end - start
    assert sampler.prefilled_tokens == sum(map(len, prompts)) + observed
