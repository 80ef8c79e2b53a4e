"""verl's interactions (multi_turn.interaction_config_path): the file, the built-in GSM8K interaction against verl's
behaviour, a user's class written against verl's BaseInteraction, bad input, and a GRPO run whose simulated user
answers every turn, whose turn scores reach the reward function, and whose rollouts are over-sampled."""

import asyncio
import json
import sys

import numpy as np
import pytest

from rlhf_jax.agents.interactions import (BaseInteraction, Gsm8kInteraction, Interactions, check_rows,
                                          interaction_reply, read_config)
from rlhf_jax.data.records import Example
from tests.train.helpers import make_config, read_metrics

# verl's examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml, as it is
VERL_FILE = 'interaction:\n  - name: "gsm8k"\n    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"\n' \
            '    config: {}'

# A user's interaction, written against verl's base class (verl is not installed here): it asks again until the
# row's ``rounds`` answers were given, scoring each answer by its length; it checks the conversation it is shown.
AGAIN = '''
from verl.interactions.base import BaseInteraction


class AgainInteraction(BaseInteraction):
    def __init__(self, config):
        super().__init__(config)
        self.answers = {}

    async def start_interaction(self, instance_id=None, rounds=1, **kwargs):
        self.answers[instance_id] = 0
        return instance_id

    async def generate_response(self, instance_id, messages, rounds=1, **kwargs):
        assert messages[-1]["role"] == "assistant" and "<|im_end|>" not in messages[-1]["content"], messages[-1]
        assert [m["role"] for m in messages[-2 * self.answers[instance_id] - 1::2]] == ["assistant"] * (
            self.answers[instance_id] + 1), messages
        self.answers[instance_id] += 1
        done = self.answers[instance_id] >= int(rounds)
        return done, f"Again ({self.answers[instance_id]})." if not done else "Done.", len(messages[-1]["content"]) / 10, {}
'''

# The reward function reads the interaction's turn scores, as a verl reward function reads them.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(extra_info["turn_scores"]))
'''


def _run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_verls_file_gives_the_built_in_gsm8k_interaction_which_grades_like_verls(tmp_path):
    path = tmp_path / "gsm8k_interaction_config.yaml"
    path.write_text(VERL_FILE)
    [entry] = read_config(str(path))
    assert entry.name == "gsm8k" and entry.cls is Gsm8kInteraction and entry.config == {"name": "gsm8k"}
    g = Gsm8kInteraction({"name": "gsm8k"})
    iid = _run(g.start_interaction("a", ground_truth="72", query="q"))
    wrong = _run(g.generate_response(iid, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "It is 70"}]))
    assert wrong == (False, "Your response is incorrect! You need to reflect on your answer and try again.", 0.0, {})
    right = _run(g.generate_response(iid, [{"role": "assistant", "content": "so #### 72"}, {"role": "user", "content": "x"}]))
    assert right == (True, "Your response is correct!", 1.0, {})  # the last assistant message is graded
    assert _run(g.generate_response(iid, [{"role": "assistant", "content": "the answer is 72."}]))[2] == 1.0  # flexible
    # verl's base class answers for a subclass that does not
    assert _run(BaseInteraction({}).generate_response("x", [])) == (False, "Your current result seems acceptable.", 0.8,
                                                                    {})


def test_a_users_class_written_against_verls_base_runs_without_verl(tmp_path):
    (tmp_path / "again.py").write_text(AGAIN)
    path = tmp_path / "interactions.yaml"
    path.write_text(f"interaction:\n  - class_name: {tmp_path / 'again.py'}:AgainInteraction\n    config: {{k: 1}}\n")
    [entry] = read_config(str(path))
    assert entry.name == "again" and entry.config == {"k": 1, "name": "again"}  # verl's default name
    assert "verl" not in sys.modules  # the stand-in base module is gone after the import
    run = Interactions([entry])
    try:
        interaction, kwargs = run.pick({"interaction_kwargs": {"name": "again", "rounds": 2}}, 0)
        messages, scores = [{"role": "user", "content": "hi"}], []
        reply = interaction_reply(run, interaction, kwargs, messages, None, lambda t: t.replace("<|im_end|>", ""),
                                  scores)
        first = reply("abcd<|im_end|>", False)
        assert (first.messages, first.done, first.reward) == ([{"role": "user", "content": "Again (1)."}], False, 0.4)
        second = reply("ab", False)
        assert second.done and scores == [0.4, 0.2]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
        assert reply("x", True) is None  # the last allowed turn: nothing would read an answer
    finally:
        run.close()


@pytest.mark.parametrize("text,message", [
    (None, r"=.*i\.yaml: no such file"),
    ("interaction: [", r"not valid YAML"),
    ("tools: []", r"expected an 'interaction:' list of entries with a class_name"),
    ("interaction:\n  - {name: a, class_name: gsm8k}\n  - {name: a, class_name: gsm8k}", r"interaction 'a' is listed twice"),
    ("interaction:\n  - {name: a, class_name: no_such_module.Thing}", r"interaction 'a': cannot import 'no_such_module'"),
    ("interaction:\n  - {name: a, class_name: json.JSONDecoder}", r"'json\.JSONDecoder' is not an interaction class"),
])
def test_bad_interaction_files_are_one_line_errors_naming_the_key(tmp_path, text, message):
    path = tmp_path / "i.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=r"multi_turn\.interaction_config_path.*" + message):
        read_config(str(path))


def test_a_row_without_its_interaction_is_named():
    rows = [Example(prompt="p", ground_truth="1", data_source="d", extra_info={"interaction_kwargs": {"name": "gsm8k"}},
                    where="train.parquet row 0"),
            Example(prompt="p", ground_truth="1", data_source="d", extra_info={}, where="train.parquet row 1")]
    check_rows(["gsm8k"], rows[:1])
    with pytest.raises(ValueError, match=r"^train\.parquet row 1: has no extra_info\.interaction_kwargs\.name; "
                                         r"actor_rollout_ref\.rollout\.multi_turn\.interaction_config_path defines "
                                         r"\['gsm8k'\]$"):
        check_rows(["gsm8k"], rows)


def test_grpo_trains_with_a_simulated_user_whose_scores_reach_the_reward_function(tmp_path):
    (tmp_path / "again.py").write_text(AGAIN)
    (tmp_path / "reward.py").write_text(REWARD)
    config = tmp_path / "interactions.yaml"
    config.write_text(f"interaction:\n  - name: again\n    class_name: {tmp_path / 'again.py'}:AgainInteraction\n")
    rows = [{"prompt": [{"role": "user", "content": f"Say {i}."}], "data_source": "chat",
             "reward_model": {"ground_truth": str(i)},
             "extra_info": {"interaction_kwargs": {"name": "again", "rounds": 1 + i % 3}}} for i in range(16)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    mt = "actor_rollout_ref.rollout.multi_turn."
    out = str(tmp_path / "run")
    from rlhf_jax.train.trainer import Trainer

    trainer = Trainer(make_config(out, "grpo", **{
        mt + "enable": True, mt + "interaction_config_path": str(config), mt + "max_tokens_per_turn": 6,
        mt + "max_assistant_turns": 4, "data.train_files": (str(data),), "data.val_files": (str(data),),
        "data.max_prompt_length": 32, "data.max_response_length": 96, "data.prompt_template": "native",
        "custom_reward_function.path": str(tmp_path / "reward.py"), "trainer.total_training_steps": 2,
        "actor_rollout_ref.rollout.over_sample_rate": 0.5}))
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["multi_turn/masked_token_fraction"] < 1  # its messages are in the responses, untrained
        assert r["critic/score/mean"] >= r["multi_turn/interaction_score/mean"] > 0  # sums of turn scores
        assert np.isfinite(r["actor/pg_loss"])
        # over-sampling: once half the episodes were done the others were cut off, trained as empty responses
        assert r["multi_turn/aborted_fraction"] <= 0.5
        assert r["response_length/min"] == 0 or not r["multi_turn/aborted_fraction"]
    assert any(r["multi_turn/aborted_fraction"] > 0 for r in rows)
    assert any(r["multi_turn/num_turns/max"] > r["multi_turn/num_turns/mean"] > 1 for r in rows)  # asked again
