"""Word problems (builtin:word_problems): deterministic, disjoint splits, answers that match their worked solution."""

import re

import pytest

from rlhf_jax.data.sources import read_file
from rlhf_jax.data.synthetic import make_word_problems
from rlhf_jax.data.word_problems import INSTRUCTION
from rlhf_jax.rewards.registry import scorer_name
from rlhf_jax.rewards.gsm8k import compute_score
from rlhf_jax.rewards.registry import default_compute_score


def test_deterministic_distinct_and_disjoint_splits():
    train = make_word_problems(3000, seed=0)
    assert train == make_word_problems(3000, seed=0) and train != make_word_problems(3000, seed=5)
    test = make_word_problems(300, seed=1, split="test")
    questions = [r["extra_info"]["question"] for r in train]
    assert len(set(questions)) == len(questions)
    assert not set(questions) & {r["extra_info"]["question"] for r in test}
    # Held-out membership does not depend on the seed: another seed's test split is disjoint from train too.
    assert not set(questions) & {r["extra_info"]["question"] for r in make_word_problems(300, seed=9, split="test")}


def test_answers_follow_from_the_worked_solution_and_score_as_gsm8k():
    rows = make_word_problems(400, seed=2, max_value=40)
    assert {r["extra_info"]["template"] for r in rows} >= {"buy_more", "give_away", "packs", "share", "buy_packs",
                                                           "sell_twice", "wage", "two_friends"}
    for r in rows:
        truth = r["reward_model"]["ground_truth"]
        work, final = r["extra_info"]["answer"].split("\n#### ")
        assert final == truth and int(truth) >= 0
        first = work.split(" = ")[0]
        # independent check: Python's integer arithmetic on the generated text (// for the exact divisions)
        assert eval(first.replace("/", "//")) == int(truth)  # noqa: S307 - generator output
        numbers = [int(x) for x in re.findall(r"\d+", r["extra_info"]["question"])]
        assert max(numbers) <= 40 * 40  # products (a total to share, money to spend) stay within max_value^2
        assert r["prompt"][0]["content"].endswith(INSTRUCTION) and r["data_source"] == "word_problems"
        assert compute_score(r["extra_info"]["answer"], truth) == 1.0  # strict: the reference solution passes
        assert compute_score(work, truth) == 0.0  # no "####": no answer in strict mode
        # the data source's scorer takes the final number
        assert default_compute_score("word_problems", work, truth) == 1.0
        assert default_compute_score("word_problems", work + f" or maybe {int(truth) + 1}", truth) == 0.0
    assert scorer_name("word_problems") == "word_problems"
    assert {len(make_word_problems(50, 0, max_steps=1))} == {50}
    assert {r["extra_info"]["template"] for r in make_word_problems(200, 0, max_steps=1)} == {
        "buy_more", "give_away", "packs", "share"}


def test_builtin_spec_and_bad_knobs():
    rows = read_file("builtin:word_problems?train_size=7&max_steps=1", "train")
    assert len(rows) == 7 and rows[0].data["extra_info"]["split"] == "train"
    short = read_file("builtin:word_problems?train_size=7&max_steps=1&instruction=answer_only", "train")
    assert [r.data["extra_info"] for r in short] == [r.data["extra_info"] for r in rows]  # same problems
    assert short[0].data["prompt"][0]["content"].endswith(" Answer with just the final number.")
    with pytest.raises(ValueError, match="instruction must be one of"):
        make_word_problems(5, instruction="shout")
    assert len(read_file("builtin:word_problems?test_size=5", "test")) == 5
    with pytest.raises(ValueError, match="max_steps"):
        make_word_problems(5, max_steps=3)
    with pytest.raises(ValueError, match="distinct"):
        make_word_problems(20000, max_value=5, max_steps=1)
