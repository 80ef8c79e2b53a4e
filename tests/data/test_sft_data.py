"""SFT data: prompt/response ids and loss masks (single turn, Question/Answer files, chat conversations), truncation,
bad rows named by file and row, the loader's layout and exact resume, the calculator demonstrations (tool results
untrained) and the tool schemas rendered like the multi-turn rollout's prompts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from ml_collections import ConfigDict

from rlhf_jax.agents.tool_calls import parse_hermes
from rlhf_jax.agents.tools import get_tool
from rlhf_jax.data.sft import SFTLoader, build_sft_dataset, sft_settings
from rlhf_jax.data.sources import DataError, read_files
from rlhf_jax.tools import tiny


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(tiny.ensure())


def _settings(**kw):
    base = dict(prompt_key=None, response_key=None, multiturn=False, messages_key="messages", template="raw",
                system_prompt=None, chat_kwargs={})
    return {**base, **kw}


def _rows(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return read_files(str(path))


def _build(tok, rows, max_length=64, truncation="error", **kw):
    return build_sft_dataset(rows, tok, settings=_settings(**kw), max_length=max_length, truncation=truncation)


def test_single_turn_trains_on_the_response_and_eos(tmp_path, tok):
    ds = _build(tok, _rows(tmp_path, [{"Question": "12+30=", "Answer": "42"}]))  # recognised by name, any case
    assert tok.decode(ds.prompts[0]) == "12+30=" and tok.decode(ds.responses[0]) == "42" + tok.eos_token
    assert ds.loss_masks[0].tolist() == [1, 1, 1]


def test_native_template_prompt_is_the_generation_prompt(tmp_path, tok):
    ds = _build(tok, _rows(tmp_path, [{"prompt": "hi", "response": "yo"}]), template="native", system_prompt="be brief")
    expected = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                       add_generation_prompt=True, tokenize=False)
    assert tok.decode(ds.prompts[0]) == expected and tok.decode(ds.responses[0]) == "yo" + tok.eos_token


def test_conversation_trains_on_assistant_messages_only(tmp_path, tok):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                {"role": "assistant", "content": "6"}]
    ds = _build(tok, _rows(tmp_path, [{"messages": messages}]), max_length=256, multiturn=True)
    ids = np.concatenate([ds.prompts[0], ds.responses[0]])
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)  # the whole conversation, once
    mask = np.concatenate([np.zeros(len(ds.prompts[0]), int), ds.loss_masks[0]])
    trained = [tok.decode(ids[i:j]) for i, j in _runs(mask)]
    assert trained == ["4<|im_end|>\n", "6<|im_end|>\n"]  # contents and end of turn, not the role headers
    assert tok.decode(ds.prompts[0]).endswith("<|im_start|>assistant\n")


def _runs(mask):
    """(start, end) of the runs of ones."""
    edges = np.diff(np.concatenate([[0], mask, [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def test_calculator_demos_train_the_call_and_the_answer_not_the_tool_result(tok):
    rows = read_files("builtin:calculator_demos?train_size=8&min_value=1000&max_value=9999")
    ds = _build(tok, rows, max_length=256, multiturn=True)
    for row, prompt, response, mask in zip(rows, ds.prompts, ds.responses, ds.loss_masks):
        expr, value = row.data["extra_info"]["expression"], row.data["reward_model"]["ground_truth"]
        a, op, b = expr.partition("*")
        assert op and 1000 <= int(a) <= 9999 and 10 <= int(b) <= 99 and int(value) == int(a) * int(b)
        ids = np.concatenate([prompt, response])
        full = np.concatenate([np.zeros(len(prompt), int), mask])
        assert tok.decode(ids) == tok.apply_chat_template(row.data["messages"], tokenize=False)
        trained = [tok.decode(ids[i:j]) for i, j in _runs(full)]
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expr
        assert trained == [call + "<|im_end|>\n", f"#### {value}<|im_end|>\n"]
        untrained = tok.decode(ids[full == 0])
        assert f"<|im_start|>tool\n{value}<|im_end|>" in untrained  # the tool's message is context, not a target
    # the parser the multi-turn rollout uses reads the demonstrated call back
    parsed = parse_hermes(rows[0].data["messages"][1]["content"])
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("calculator", {"expression": rows[0].data["extra_info"]["expression"]})] and not parsed.errors


TOOLS_TEMPLATE = (  # a template that lists tool schemas in the system turn, as Qwen's and Hermes' templates do
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    + tiny.CHAT_TEMPLATE)


def test_conversations_render_the_tool_schemas_like_rollout_prompts(tok):
    tools = [get_tool("calculator").schema()]
    tok_tools = transformers.AutoTokenizer.from_pretrained(tiny.ensure())
    tok_tools.chat_template = TOOLS_TEMPLATE
    rows = read_files("builtin:calculator_demos?train_size=2")
    data_cfg = ConfigDict({"prompt_key": None, "response_key": None, "multiturn": {"enable": True, "messages_key":
                           "messages"}, "prompt_template": "native", "system_prompt": None,
                           "apply_chat_template_kwargs": {"enable_thinking": False}})
    settings = sft_settings(data_cfg, tools)
    assert settings["chat_kwargs"] == {"enable_thinking": False, "tools": tools}
    ds = build_sft_dataset(rows, tok_tools, settings=settings, max_length=512, truncation="error")
    rendered = tok_tools.decode(ds.prompts[0])
    # the prompt part is exactly what the rollout's prompt rendering gives for the same tools
    assert rendered == tok_tools.apply_chat_template(rows[0].data["messages"][:1], tools=tools, tokenize=False,
                                                     add_generation_prompt=True)
    assert '"name": "calculator"' in rendered
    whole = tok_tools.decode(np.concatenate([ds.prompts[0], ds.responses[0]]))
    assert whole == tok_tools.apply_chat_template(rows[0].data["messages"], tools=tools, tokenize=False)
    without = build_sft_dataset(rows, tok_tools, settings=sft_settings(data_cfg), max_length=512, truncation="error")
    assert "calculator" not in tok_tools.decode(without.prompts[0]).split("<|im_start|>user")[0]


def test_conversation_row_without_messages_or_assistant_is_named(tmp_path, tok):
    ok = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    rows = _rows(tmp_path, [ok, {"chat": ok["messages"]}])
    with pytest.raises(DataError, match=r"data\.jsonl row 1: missing conversation column 'messages' "
                                        r"\(data\.multiturn\.messages_key\)"):
        _build(tok, rows, multiturn=True)
    rows = _rows(tmp_path, [ok, {"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(DataError, match="row 1: conversation 'messages' has no assistant message"):
        _build(tok, rows, multiturn=True)


def test_missing_response_is_named(tmp_path, tok):
    rows = _rows(tmp_path, [{"prompt": "a", "response": "b"}, {"prompt": "a", "reply": "b"}])
    with pytest.raises(DataError, match=r"row 1: no response column .*data\.response_key"):
        _build(tok, rows)
    with pytest.raises(DataError, match=r"row 0: missing response column 'output' \(data\.response_key\)"):
        _build(tok, rows, response_key="output")


def test_truncation(tmp_path, tok):
    rows = _rows(tmp_path, [{"prompt": "abcdefgh", "response": "xyz"}, {"prompt": "ab", "response": "c"}])
    with pytest.raises(DataError, match=r"row 0: 12 tokens, longer than data\.max_length=6"):
        _build(tok, rows, max_length=6)
    left = _build(tok, rows, max_length=6, truncation="left")  # keeps the end: the response survives
    assert tok.decode(np.concatenate([left.prompts[0], left.responses[0]])) == "ghxyz" + tok.eos_token
    assert left.loss_masks[0].sum() == 4
    right = _build(tok, rows, max_length=9, truncation="right")  # keeps the start: one response token left
    assert tok.decode(right.responses[0]) == "x" and len(right) == 2
    dropped = _build(tok, rows, max_length=6, truncation="right")  # nothing of the response: the row is skipped
    assert len(dropped) == 1 and tok.decode(dropped.responses[0]) == "c" + tok.eos_token


def test_loader_pads_to_buckets_and_resumes_exactly(tmp_path, tok):
    rows = _rows(tmp_path, [{"prompt": "p" * (1 + i % 7), "response": "r" * (1 + i % 5)} for i in range(24)])
    ds = _build(tok, rows)
    loader = SFTLoader(ds, 8, pad_token_id=tok.pad_token_id, max_length=64, seed=3, num_epochs=None,
                       process_index=0, process_count=1)
    first = [next(loader) for _ in range(2)]
    state = loader.get_state()
    rest = [next(loader) for _ in range(4)]  # across the epoch boundary (3 batches an epoch)
    loader.set_state(state)
    again = [next(loader) for _ in range(4)]
    for a, b in zip(rest, again):
        for field in ("prompts", "prompt_mask", "responses", "response_mask", "loss_mask"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    b = first[0]
    assert b.prompts.shape[1] == 16 and b.responses.shape[1] == 16  # power-of-two buckets from 16
    for i in range(8):  # each row: left-padded prompt, right-padded response, loss only on real response tokens
        assert b.prompt_mask[i, -1] == 1 and b.response_mask[i, 0] == 1
        assert (b.loss_mask[i] <= b.response_mask[i]).all()
    assert rest[1].epoch == 1 and first[0].epoch == 0
