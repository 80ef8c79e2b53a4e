"""Prompt ids match the real SmolLM2 chat template; truncation, filtering, padding and buckets."""

import logging

import numpy as np
import pytest

from rlhf_jax.data.prompts import (
    bucket_length,
    pad_left,
    render_prompt,
    resolve_buckets,
    tokenize_examples,
    truncate_ids,
)
from rlhf_jax.data.records import Example
from rlhf_jax.data.sources import DataError


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _ex(prompt, i=0):
    return Example(prompt=prompt, ground_truth="1", data_source="gsm8k", extra_info={}, where=f"f.parquet row {i}")


def _reference_ids(tok, messages):
    out = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_native_template_equals_apply_chat_template(tok):
    prompts = [
        "What is 17 + 25?",
        [{"role": "user", "content": "Name a prime number."}],
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Capital of Italy?"},
         {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "And of Spain?"}],
    ]
    examples = [_ex(p, i) for i, p in enumerate(prompts)]
    kept, ids, texts = tokenize_examples(examples, tok, max_prompt_length=256)
    assert len(kept) == 3
    for p, got, text in zip(prompts, ids, texts):
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else p
        assert got.dtype == np.int32
        assert got.tolist() == _reference_ids(tok, messages)
        assert text.endswith("<|im_start|>assistant\n")


def test_system_prompt(tok):
    (_, ids, _) = tokenize_examples([_ex("Hi")], tok, max_prompt_length=256, system_prompt="Be terse.")
    ref = _reference_ids(tok, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    assert ids[0].tolist() == ref
    # messages that already carry a system message keep theirs
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Hi"}]
    (_, ids, _) = tokenize_examples([_ex(own)], tok, max_prompt_length=256, system_prompt="Be terse.")
    assert ids[0].tolist() == _reference_ids(tok, own)


def test_raw_and_string_template(tok):
    text, special = render_prompt("2+3=", tok, "raw")
    assert (text, special) == ("2+3=", True)
    text, _ = render_prompt([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], tok, "raw")
    assert text == "a\nb"
    text, _ = render_prompt("2+3", tok, "Question: {prompt}\nAnswer:", system_prompt="Sys")
    assert text == "Sys\nQuestion: 2+3\nAnswer:"
    text, _ = render_prompt("2+3", tok, "[{system_prompt}] {prompt} =", system_prompt="S")
    assert text == "[S] 2+3 ="
    (_, ids, _) = tokenize_examples([_ex("2+3=")], tok, max_prompt_length=64, template="raw")
    assert ids[0].tolist() == tok("2+3=")["input_ids"]
    with pytest.raises(DataError, match="prompt_template"):
        render_prompt("x", tok, "no placeholder")


def test_truncation_modes_on_overlong_prompt(tok):
    long_prompt = " ".join(f"word{i}" for i in range(80))
    full = _reference_ids(tok, [{"role": "user", "content": long_prompt}])
    n = 31
    assert len(full) > n
    expected = {"left": full[-n:], "right": full[:n], "middle": full[: n // 2] + full[-(n - n // 2):]}
    for mode, ref in expected.items():
        (_, ids, _) = tokenize_examples([_ex(long_prompt)], tok, max_prompt_length=n, truncation=mode)
        assert ids[0].tolist() == ref, mode
        assert len(ids[0]) == n
    short = [_ex("hi", 0)]
    (_, ids, _) = tokenize_examples(short, tok, max_prompt_length=64, truncation="left")
    assert ids[0].tolist() == _reference_ids(tok, [{"role": "user", "content": "hi"}])


def test_error_mode_names_the_row(tok):
    examples = [_ex("short", 0), _ex(" ".join(["many words"] * 40), 7)]
    with pytest.raises(DataError, match=r"f\.parquet row 7: prompt is \d+ tokens, longer than data\.max_prompt_length=40"):
        tokenize_examples(examples, tok, max_prompt_length=40, truncation="error")
    with pytest.raises(DataError, match="data.truncation must be one of"):
        tokenize_examples(examples, tok, max_prompt_length=40, truncation="sideways")


def test_filter_overlong_prompts_logs_a_count(tok, caplog):
    examples = [_ex("short", 0), _ex(" ".join(["many words"] * 40), 1), _ex("also short", 2)]
    with caplog.at_level(logging.WARNING):
        kept, ids, _ = tokenize_examples(examples, tok, max_prompt_length=40, filter_overlong_prompts=True)
    assert [e.where for e in kept] == ["f.parquet row 0", "f.parquet row 2"]
    assert "dropped 1 of 3 prompts" in caplog.text


def test_truncate_ids_pure():
    ids = list(range(10))
    assert truncate_ids(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate_ids(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate_ids(ids, 5, "middle") == [0, 1, 7, 8, 9]
    assert truncate_ids(ids, 1, "middle") == [9]
    assert truncate_ids(ids, 10, "error") == ids


def test_pad_left_and_buckets():
    rng = np.random.default_rng(0)
    rows = [rng.integers(3, 100, size=n).astype(np.int32) for n in (5, 1, 8)]
    ids, mask = pad_left(rows, 8, pad_token_id=2)
    assert ids.dtype == np.int32 and mask.dtype == np.int32 and ids.shape == (3, 8)
    for i, r in enumerate(rows):
        assert ids[i, 8 - len(r):].tolist() == r.tolist()
        assert (ids[i, : 8 - len(r)] == 2).all()
        assert mask[i].tolist() == [0] * (8 - len(r)) + [1] * len(r)
    buckets = resolve_buckets(64, [16, 32])
    assert buckets == (16, 32, 64)
    assert [bucket_length(n, buckets) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert resolve_buckets(64, None) == (16, 32, 64)
    assert resolve_buckets(100, None) == (16, 32, 64, 100)
    assert resolve_buckets(8, None) == (8,)
    with pytest.raises(DataError, match="prompt_length_buckets"):
        resolve_buckets(64, [128])


def test_chat_template_kwargs_reach_the_template(tok):
    import copy

    from rlhf_jax.data.prompts import render_prompt

    t = copy.deepcopy(tok)
    t.chat_template = "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}" \
                      "{{ messages[-1]['content'] }}"
    assert render_prompt("2+2=", t, "native")[0] == "2+2="
    assert render_prompt("2+2=", t, "native", chat_template_kwargs={"enable_thinking": False})[0] == "/no_think 2+2="
