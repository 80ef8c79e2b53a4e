"""Preference pairs: the generated arithmetic set, response tokenization per template, length limits, bad rows."""

from __future__ import annotations

import json

import pytest
import transformers

from rlhf_jax.data import DataError
from rlhf_jax.data.preferences import build_preference_dataset
from rlhf_jax.data.synthetic import make_arithmetic_preferences
from rlhf_jax.rewards.expression import evaluate
from rlhf_jax.tools import tiny


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(tiny.ensure())


def _jsonl(tmp_path, rows) -> str:
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_generated_pairs_prefer_the_right_value():
    rows = make_arithmetic_preferences(200, 3, max_value=9, max_offset=2)
    assert rows == make_arithmetic_preferences(200, 3, max_value=9, max_offset=2)  # deterministic
    for row in rows:
        value = int(evaluate(row["extra_info"]["expression"])[0])
        assert row["chosen"] == str(value)
        wrong = int(row["rejected"])
        assert wrong != value and abs(wrong - value) <= 2 and wrong >= 0


def test_raw_template_appends_eos_and_native_renders_a_turn(tmp_path, tok):
    data = _jsonl(tmp_path, [{"prompt": "2+2=", "chosen": "4", "rejected": "five"}])
    raw = build_preference_dataset(data, tok, prompt_template="raw", max_prompt_length=16, max_response_length=8)
    assert tok.decode(raw.prompts.input_ids[0]) == "2+2="
    assert list(raw.chosen[0]) == tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    native = build_preference_dataset(data, tok, prompt_template="native", max_prompt_length=64, max_response_length=8)
    assert tok.decode(native.rejected[0]) == "five<|im_end|>\n"
    assert native.prompts.prompt_texts[0].endswith("<|im_start|>assistant\n")


def test_long_responses_error_or_keep_their_start(tmp_path, tok):
    data = _jsonl(tmp_path, [{"prompt": "q", "chosen": "short", "rejected": "a much longer answer"}])
    with pytest.raises(DataError, match=r"prefs\.jsonl row 0: column 'rejected' is 21 tokens, longer than "
                                        r"data\.max_response_length=8"):
        build_preference_dataset(data, tok, prompt_template="raw", max_prompt_length=16, max_response_length=8)
    cut = build_preference_dataset(data, tok, prompt_template="raw", max_prompt_length=16, max_response_length=8,
                                   truncation="right")
    assert tok.decode(cut.rejected[0]) == "a much l" and len(cut.chosen[0]) == 6


@pytest.mark.parametrize("row,message", [
    ({"prompt": "q", "chosen": "a"}, r"row 0: missing column 'rejected' \(data\.rejected_key\)"),
    ({"prompt": "q", "rejected": "a"}, r"row 0: missing column 'chosen' \(data\.chosen_key\)"),
    ({"prompt": "q", "chosen": 3, "rejected": "a"}, r"row 0: column 'chosen' must be a string or a non-empty list"),
    ({"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant"}]}, r"column 'rejected' message 0 must be"),
    ({"question": "", "chosen": "a", "rejected": "b"}, r"prompt column 'question' is empty"),
])
def test_bad_rows_name_file_row_and_column(tmp_path, tok, row, message):
    data = _jsonl(tmp_path, [row])
    with pytest.raises(DataError, match=message):
        build_preference_dataset(data, tok, prompt_template="raw", max_prompt_length=16, max_response_length=8)


def test_generated_parquet_reads_back_as_pairs(tmp_path, tok):
    from rlhf_jax.data.synthetic import generate

    train, _ = generate("arithmetic_preferences", str(tmp_path), train_size=6, test_size=2, seed=0, max_value=9)
    ds = build_preference_dataset(train, tok, prompt_template="raw", max_prompt_length=16, max_response_length=4)
    rows = make_arithmetic_preferences(6, 0, max_value=9)
    assert [tok.decode(x) for x in ds.prompts.input_ids] == [r["prompt"][0]["content"] for r in rows]
    assert [tok.decode(x) for x in ds.chosen] == [r["chosen"] + tok.eos_token for r in rows]
    assert [tok.decode(x) for x in ds.rejected] == [r["rejected"] + tok.eos_token for r in rows]


def test_max_length_bounds_prompt_plus_either_response(tmp_path, tok):
    """ROLL's DPO pipeline drops a pair whose prompt + chosen or prompt + rejected exceeds its sequence_length."""
    data = _jsonl(tmp_path, [{"prompt": "q", "chosen": "ab", "rejected": "abcdef"},  # 1 + 7 tokens (with eos)
                             {"prompt": "r", "chosen": "a", "rejected": "b"}])  # 1 + 2
    kept = build_preference_dataset(data, tok, prompt_template="raw", max_prompt_length=8, max_response_length=8,
                                    max_length=6, filter_overlong_prompts=True)
    assert len(kept) == 1 and tok.decode(kept.prompts.input_ids[0]) == "r"
    assert tok.decode(kept.chosen[0]).startswith("a") and len(kept.rejected) == 1
    with pytest.raises(DataError, match=r"prefs\.jsonl row 0: prompt \+ response is 8 tokens, more than "
                                        r"data\.max_length=6"):
        build_preference_dataset(data, tok, prompt_template="raw", max_prompt_length=8, max_response_length=8,
                                 max_length=6)
    whole = build_preference_dataset(data, tok, prompt_template="raw", max_prompt_length=8, max_response_length=8)
    assert len(whole) == 2  # no max_length: only each part's own bound
