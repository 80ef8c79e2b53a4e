"""Synthetic arithmetic / countdown generators: deterministic, verl schema, solvable, CLI."""


import pyarrow.parquet as pq
import pytest

from rlhf_jax.data.records import to_examples
from rlhf_jax.data.sources import read_files
from rlhf_jax.data.synthetic import make_arithmetic, make_countdown
from rlhf_jax.rewards import arithmetic, countdown
from rlhf_jax.rewards.expression import evaluate
from tests.train.helpers import run_tool


def test_arithmetic_deterministic_and_correct():
    a = make_arithmetic(50, seed=3, min_value=-20, max_value=20, num_terms=4, ops="+-*")
    assert a == make_arithmetic(50, seed=3, min_value=-20, max_value=20, num_terms=4, ops="+-*")
    assert a != make_arithmetic(50, seed=4, min_value=-20, max_value=20, num_terms=4, ops="+-*")
    for row in a:
        expr = row["extra_info"]["expression"]
        # independent check: Python's own integer arithmetic on the generated (trusted) text
        assert int(row["reward_model"]["ground_truth"]) == eval(expr)  # noqa: S307 - generator output, not model output
        assert row["prompt"] == [{"role": "user", "content": f"{expr}="}]
        assert row["data_source"] == "arithmetic"
        assert arithmetic.compute_score(row["reward_model"]["ground_truth"], row["reward_model"]["ground_truth"]) == 1.0
    easy = make_arithmetic(200, seed=0)
    assert all(0 <= int(r["reward_model"]["ground_truth"]) <= 18 for r in easy)
    instruct = make_arithmetic(1, seed=0, style="instruct")[0]["prompt"][0]["content"]
    assert "####" in instruct
    with pytest.raises(ValueError, match="ops must be"):
        make_arithmetic(1, ops="/")


def test_countdown_targets_are_reachable():
    rows = make_countdown(40, seed=1, num_numbers=4, max_number=30, max_target=200)
    assert rows == make_countdown(40, seed=1, num_numbers=4, max_number=30, max_target=200)
    for row in rows:
        gt = row["reward_model"]["ground_truth"]
        assert len(gt["numbers"]) == 4 and 1 <= gt["target"] <= 200
        solution = row["extra_info"]["solution"]
        value, used = evaluate(solution)
        assert value == gt["target"] and sorted(used) == sorted(gt["numbers"])
        assert countdown.compute_score(f"<answer>{solution}</answer>", gt) == 1.0


def test_cli_writes_verl_parquet(tmp_path):
    out = tmp_path / "arith"
    run_tool("rlhf_jax.data.synthetic", "--task", "arithmetic", "--out", str(out), "--train-size", "30", "--test-size",
             "5", "--max-value", "99", "--num-terms", "3", "--ops", "+*", timeout=120).check_returncode()
    table = pq.read_table(out / "train.parquet")
    assert table.num_rows == 30
    assert set(table.column_names) >= {"data_source", "prompt", "reward_model", "extra_info"}
    examples = to_examples(read_files(str(out / "test.parquet")))
    assert len(examples) == 5 and isinstance(examples[0].prompt, list)
    assert int(examples[0].ground_truth) == eval(examples[0].extra_info["expression"])  # noqa: S307

    cd = tmp_path / "cd"
    run_tool("rlhf_jax.data.synthetic", "--task", "countdown", "--out", str(cd), "--train-size", "8", "--test-size", "2",
             timeout=120).check_returncode()
    ex = to_examples(read_files(str(cd / "train.parquet")))
    assert isinstance(ex[0].ground_truth, dict) and set(ex[0].ground_truth) == {"target", "numbers"}
