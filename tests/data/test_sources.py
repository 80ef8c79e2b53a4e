"""Reading every supported source layout, and clear errors on bad data."""

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_jax.data.records import to_examples
from rlhf_jax.data.sources import DataError, get_path, read_files

QA = {
    "train": [{"Question": "What is 2+2?", "Answer": "4"}, {"Question": "Capital of France?", "Answer": "Paris"}],
    "test": [{"Question": "What is 3*3?", "Answer": "9"}],
}

VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Natalia sold 48 clips... Let's think step by step."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "lighteval/MATH",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 1/2+1/2."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1"},
        "extra_info": {"split": "train", "index": 1},
    },
]


def test_qa_json_by_split(tmp_path):
    """The seed trainer's {"train": [...], "test": [...]} layout, read per split."""
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(QA))
    train = to_examples(read_files(str(path), "train"), "Question", "Answer", default_data_source="qa")
    test = to_examples(read_files([str(path)], "test"), "Question", "Answer", default_data_source="qa")
    assert [e.prompt for e in train] == ["What is 2+2?", "Capital of France?"]
    assert [e.ground_truth for e in train] == ["4", "Paris"]
    assert [(e.prompt, e.ground_truth) for e in test] == [("What is 3*3?", "9")]
    assert train[0].data_source == "qa"
    assert train[1].extra_info["Answer"] == "Paris"  # other columns travel to the reward function
    with pytest.raises(DataError, match=r"split 'validation' not found.*\['test', 'train'\]"):
        read_files(str(path), "validation")


def test_verl_parquet_schema(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    examples = to_examples(read_files(str(path)))
    assert examples[0].prompt == VERL_ROWS[0]["prompt"]
    assert examples[1].prompt[0] == {"role": "system", "content": "Be brief."}
    assert [e.ground_truth for e in examples] == ["72", "1"]
    assert [e.data_source for e in examples] == ["openai/gsm8k", "lighteval/MATH"]
    assert examples[0].extra_info["split"] == "train" and examples[0].extra_info["index"] == 0
    assert examples[0].extra_info["ability"] == "math"
    assert examples[0].where == f"{path} row 0"


def test_jsonl_csv_and_json_list(tmp_path):
    rows = [{"prompt": f"question {i}", "answer": str(i), "data_source": "arithmetic"} for i in range(3)]
    jl = tmp_path / "a.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    js = tmp_path / "b.json"
    js.write_text(json.dumps(rows))
    cs = tmp_path / "c.csv"
    with open(cs, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "answer", "data_source"])
        w.writeheader()
        w.writerows(rows)
    for path in (jl, js, cs):
        ex = to_examples(read_files(str(path)), "prompt", "answer")
        assert [(e.prompt, e.ground_truth, e.data_source) for e in ex] == [
            (r["prompt"], r["answer"], "arithmetic") for r in rows
        ], path
    both = read_files([str(jl), str(cs)])
    assert len(both) == 6 and both[3].file == str(cs) and both[3].index == 0


def test_roll_messages_column_in_jsonl_and_csv(tmp_path):
    """ROLL's `messages` column: a list in JSONL, a JSON-encoded list in CSV."""
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    jl = tmp_path / "m.jsonl"
    jl.write_text(json.dumps({"messages": msgs, "tag": "x"}) + "\n")
    cs = tmp_path / "m.csv"
    with open(cs, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["messages", "tag"])
        w.writerow([json.dumps(msgs), "x"])
    for path in (jl, cs):
        (ex,) = to_examples(read_files(str(path)), "messages", "", default_data_source="chat")
        assert ex.prompt == msgs and ex.ground_truth is None and ex.extra_info == {"tag": "x"}


def test_trinity_taskset_directory(tmp_path):
    """Trinity-RFT: a directory of split-named files, prompt_key/response_key = question/answer."""
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q1", "answer": "a1"}) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "q2", "answer": "a2"}) + "\n")
    train = to_examples(read_files(str(tmp_path), "train"), "question", "answer", "countdown")
    test = to_examples(read_files(str(tmp_path), "test"), "question", "answer", "countdown")
    assert [(e.prompt, e.ground_truth) for e in train] == [("q1", "a1")]
    assert [(e.prompt, e.ground_truth) for e in test] == [("q2", "a2")]


def test_column_oriented_json_and_json_lines_in_dot_json(tmp_path):
    col = tmp_path / "col.json"
    col.write_text(json.dumps({"prompt": ["a", "b"], "gt": ["1", "2"]}))
    assert [r.data for r in read_files(str(col))] == [{"prompt": "a", "gt": "1"}, {"prompt": "b", "gt": "2"}]
    lines = tmp_path / "lines.json"
    lines.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [r.data["prompt"] for r in read_files(str(lines))] == ["a", "b"]


def test_dotted_path():
    row = {"reward_model": {"ground_truth": {"target": 3}}, "a.b": 1}
    assert get_path(row, "reward_model.ground_truth.target") == 3
    assert get_path(row, "a.b") == 1
    with pytest.raises(KeyError):
        get_path(row, "reward_model.missing")


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("empty.jsonl", "", r"empty\.jsonl: contains no rows"),
        ("bad.json", '{"train": [', r"bad\.json: not valid JSON"),
        ("bad.jsonl", '{"prompt": "ok"}\n{oops}\n', r"bad\.jsonl: line 2 is not valid JSON"),
        ("corrupt.parquet", "this is not parquet", r"corrupt\.parquet: cannot read as parquet"),
        ("data.txt", "hello", r"data\.txt: unsupported file type"),
        ("scalar.jsonl", '{"prompt": "ok"}\n3\n', r"scalar\.jsonl: row 1 is a int"),
    ],
)
def test_unreadable_files_name_the_file(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=match):
        read_files(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet: file not found"):
        read_files(str(tmp_path / "nope.parquet"))


def test_bad_rows_name_file_row_and_key(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "fine", "data_source": "gsm8k", "reward_model": {"ground_truth": "1"}},
            {"question": "no prompt column", "data_source": "gsm8k"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"rows\.jsonl row 1: missing prompt column 'prompt'"):
        to_examples(read_files(str(path)), "prompt")
    path.write_text(json.dumps({"text": "no known prompt column", "answer": "1"}))
    with pytest.raises(DataError, match=r"rows\.jsonl row 0: no prompt column \(tried prompt, messages.*data\.prompt_key"):
        to_examples(read_files(str(path)))

    path.write_text(json.dumps({"prompt": 42, "data_source": "gsm8k", "reward_model": {"ground_truth": "1"}}))
    with pytest.raises(DataError, match=r"rows\.jsonl row 0: prompt column 'prompt' must be a string or a list"):
        to_examples(read_files(str(path)))

    path.write_text(json.dumps({"prompt": [{"role": "user"}], "data_source": "gsm8k"}))
    with pytest.raises(DataError, match=r"row 0: prompt column 'prompt' message 0 must be an object"):
        to_examples(read_files(str(path)))

    path.write_text(json.dumps({"prompt": "hi", "data_source": "gsm8k"}))
    with pytest.raises(DataError, match=r"row 0: missing ground-truth column 'reward_model.ground_truth'"):
        to_examples(read_files(str(path)), "prompt", "reward_model.ground_truth")
    with pytest.raises(DataError, match=r"row 0: no ground-truth column \(tried reward_model\.ground_truth.*ground_truth_key"):
        to_examples(read_files(str(path)))

    path.write_text(json.dumps({"prompt": "hi", "data_source": 3, "answer": "1"}))
    with pytest.raises(DataError, match=r"row 0: 'data_source' must be a string"):
        to_examples(read_files(str(path)))


def test_columns_recognised_by_name_and_data_source_from_the_file_name(tmp_path):
    """Seed 003's Question/Answer JSON, ROLL's messages column, Trinity's default prompt/response columns and plain
    prompt/solution rows need no keys."""
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(QA))
    train = to_examples(read_files(str(path), "train"))
    assert [(e.prompt, e.ground_truth, e.data_source) for e in train] == [
        ("What is 2+2?", "4", "qa"), ("Capital of France?", "Paris", "qa")]
    assert "Question" not in train[0].extra_info  # the prompt column is not repeated in extra_info
    roll = tmp_path / "roll_math.jsonl"
    msgs = [{"role": "user", "content": "1+1?"}]
    roll.write_text(json.dumps({"messages": msgs, "ground_truth": "2"}) + "\n")
    (ex,) = to_examples(read_files(str(roll)))
    assert (ex.prompt, ex.ground_truth, ex.data_source) == (msgs, "2", "roll_math")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"problem": "p", "solution": "s", "data_source": "math"}) + "\n")
    (ex,) = to_examples(read_files(str(plain)), default_data_source="ignored: the row names its own")
    assert (ex.prompt, ex.ground_truth, ex.data_source) == ("p", "s", "math")
    (ex,) = to_examples(read_files(str(roll)), default_data_source="gsm8k")
    assert ex.data_source == "gsm8k"
    trinity = tmp_path / "taskset.jsonl"  # Trinity-RFT's default format keys: prompt / response
    trinity.write_text(json.dumps({"prompt": "3+4=", "response": "7"}) + "\n")
    (ex,) = to_examples(read_files(str(trinity)))
    assert (ex.prompt, ex.ground_truth, ex.data_source) == ("3+4=", "7", "taskset")
    both = tmp_path / "both.jsonl"  # an answer column wins over a response column
    both.write_text(json.dumps({"prompt": "3+4=", "answer": "7", "response": "The answer is 7"}) + "\n")
    (ex,) = to_examples(read_files(str(both)))
    assert ex.ground_truth == "7" and ex.extra_info["response"] == "The answer is 7"


def test_builtin_sources():
    train = read_files("builtin:arithmetic", "train")
    test = read_files("builtin:arithmetic?test_size=7&max_value=50", "test")
    assert len(train) == 1000 and len(test) == 7
    ex = to_examples(test)
    assert all(e.data_source == "arithmetic" for e in ex)
    with pytest.raises(DataError, match="unknown builtin dataset 'nope'"):
        read_files("builtin:nope")
