"""Multi-turn rollouts continue from the device KV cache: greedy turns equal single ``generate`` calls (and
transformers' ``generate``) on the growing conversation, token for token, and later turns prefill only their new
tokens."""

from __future__ import annotations

import numpy as np
import pytest

from rlhf_jax.agents import Tool
from rlhf_jax.agents.render import tool_suffix_ids, tool_suffix_text
from rlhf_jax.agents.tool_calls import ParsedCalls, ToolCall, register_parser
from rlhf_jax.agents.turns import TurnSettings, run_turns
from rlhf_jax.rollout import SamplingParams, generate, rollout_key
from rlhf_jax.rollout.conversation_sampler import ConversationSampler

STUB = "echo_stats"


@register_parser("test_every_turn")
def _every_turn(text: str) -> ParsedCalls:
    """A call after every turn except those that hold a reserved token (these end their trajectory)."""
    if "<|reserved_" in text:
        return ParsedCalls((), ())
    return ParsedCalls((ToolCall(STUB, {"text": text}),), ())


def _stub(text: str) -> str:  # deterministic, length varies with the input
    return f"{len(text)}:{sum(map(ord, text)) % 997}" + "!" * (len(text) % 5)


TOOLS = (Tool(STUB, "length and checksum", {"type": "object"}, _stub),)


def _prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    words = ["add", "two", "numbers", "please", "what", "is", "the", "sum", "of", "nine", "and", "three"]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": " ".join(rng.choice(words, rng.integers(2, 9)))}],
                                           tokenize=False, add_generation_prompt=True) for _ in range(count)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) of the runs of equal values in a mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_turns_equal_single_generate_calls_on_the_growing_conversation(kind, checkpoints):
    from transformers import AutoTokenizer

    from rlhf_jax.models import from_pretrained

    path = checkpoints[kind]
    model = from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    eos = (tok.eos_token_id,)
    settings = TurnSettings(response_length=200, max_assistant_turns=4, max_user_turns=3, max_tokens_per_turn=7,
                            format="test_every_turn", tools=TOOLS)
    params = SamplingParams(max_new_tokens=settings.turn_len, temperature=0.0, eos_token_ids=eos,
                            pad_token_id=tok.pad_token_id)
    prompts = _prompts(tok, 6, seed=3)
    sampler = ConversationSampler.for_model(model, capacity=max(map(len, prompts)) + settings.response_length,
                                            params=params, turn_len=settings.turn_len, stage=16)
    trajs, timings = run_turns(sampler, _state(model), tok, prompts, settings, rollout_key(0), eos)

    tool_tokens = 0
    for prompt, traj in zip(prompts, trajs):
        assert traj.turns >= 1 and len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)
        assert len(traj.response_ids) <= settings.response_length
        runs = _runs(traj.loss_mask)
        assert [v for _, _, v in runs] == [1, 0] * (len(runs) // 2) + [1] * (len(runs) % 2)  # turns alternate
        for start, end, sampled in runs:
            before = prompt + traj.response_ids[:start]
            piece = traj.response_ids[start:end]
            if sampled:
                limit = min(settings.turn_len, settings.response_length - start)
                ref = generate(model, [before], max_new_tokens=limit, temperature=0.0, eos_token_ids=eos,
                               pad_token_id=tok.pad_token_id)
                assert piece == ref.tokens[0]
                np.testing.assert_allclose(traj.logprobs[start:end], ref.logprobs[0], atol=2e-5)
            else:
                text = tok.decode(traj.response_ids[runs_before(runs, start)], skip_special_tokens=False)
                message = {"role": "tool", "name": STUB, "content": _stub(text)}
                assert piece == tool_suffix_ids(tok, [message], traj.response_ids[start - 1] in eos)
                assert all(lp == 0.0 for lp in traj.logprobs[start:end])
                tool_tokens += end - start
    assert sum(t.tool_turns for t in trajs) >= 4 and any(t.turns == 4 for t in trajs)
    assert any(t.turns < 4 for t in trajs)  # a turn without a call ended a trajectory early
    # the later turns prefilled only their new tokens: the prompts once, then the tool responses
    assert sampler.prefilled_tokens == sum(map(len, prompts)) + tool_tokens
    assert timings.tool_wait_s >= 0.0


def runs_before(runs, start: int) -> slice:
    """The sampled run that ends at ``start``."""
    for s, e, v in runs:
        if e == start and v == 1:
            return slice(s, e)
    raise AssertionError(f"no sampled run before {start}")


def _state(model):
    from flax import nnx

    return nnx.split(model)[1]


def test_turns_equal_transformers_generate(checkpoints):
    """One trajectory against transformers' greedy ``generate`` on the growing conversation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_jax.models import from_pretrained

    path = checkpoints["qwen2"]
    model = from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    eos = (tok.eos_token_id,)
    settings = TurnSettings(response_length=60, max_assistant_turns=3, max_tokens_per_turn=9,
                            format="test_every_turn", tools=TOOLS)
    params = SamplingParams(max_new_tokens=9, temperature=0.0, eos_token_ids=eos, pad_token_id=tok.pad_token_id)
    prompts = _prompts(tok, 2, seed=5)
    sampler = ConversationSampler.for_model(model, capacity=max(map(len, prompts)) + 60, params=params, turn_len=9)
    trajs, _ = run_turns(sampler, _state(model), tok, prompts, settings, rollout_key(1), eos)
    for prompt, traj in zip(prompts, trajs):
        for start, end, sampled in _runs(traj.loss_mask):
            if not sampled:
                continue
            ids = torch.tensor([prompt + traj.response_ids[:start]])
            limit = min(9, 60 - start)
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit, do_sample=False,
                                  eos_token_id=list(eos), pad_token_id=tok.pad_token_id)
            assert traj.response_ids[start:end] == out[0, ids.shape[1]:].tolist()


def test_stop_sequence_ends_a_turn(checkpoints):
    """A turn ends right after a stop sequence (a tool-call end marker spelled in several tokens)."""
    from transformers import AutoTokenizer

    from rlhf_jax.models import from_pretrained

    path = checkpoints["llama"]
    model = from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _prompts(tok, 4, seed=8)
    free = generate(model, prompts, max_new_tokens=12, temperature=0.0, eos_token_ids=(), pad_token_id=tok.pad_token_id)
    marker = tuple(free.tokens[2][4:7])  # three tokens the greedy path of prompt 2 emits at 4..6
    params = SamplingParams(max_new_tokens=12, temperature=0.0, eos_token_ids=(), pad_token_id=tok.pad_token_id)
    sampler = ConversationSampler.for_model(model, capacity=max(map(len, prompts)) + 12, params=params, turn_len=12,
                                            stop_sequences=[marker])
    state = _state(model)
    conv = sampler.append(state, sampler.start(state, 4), prompts)
    _, out = sampler.decode(state, conv, [12] * 4, [0] * 4, range(4), rollout_key(0))
    for i, tokens in enumerate(free.tokens):
        cut = next((j + len(marker) for j in range(len(tokens) - len(marker) + 1)
                    if tuple(tokens[j:j + len(marker)]) == marker), None)
        expect = tokens if cut is None else tokens[:cut]
        assert out.tokens[i, :out.count[i]].tolist() == expect
        assert bool(out.stopped[i]) == (cut is not None)
    assert out.stopped[2] and out.count[2] == 7


def test_tool_suffix_is_the_new_part_of_the_rendered_conversation(checkpoints):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoints["llama"])
    history = [{"role": "user", "content": "what is 2+3?"}]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    tool = {"role": "tool", "name": "calculator", "content": "5"}
    before = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    after = tok.apply_chat_template(history + [{"role": "assistant", "content": call}, tool], tokenize=False,
                                    add_generation_prompt=True)
    assert before + call + tool_suffix_text(tok, [tool], ended_with_eos=False) == after
    assert before + call + tok.eos_token + tool_suffix_text(tok, [tool], ended_with_eos=True) == after
    generated = tok.encode(before + call + tok.eos_token, add_special_tokens=False)
    assert generated + tool_suffix_ids(tok, [tool], True) == tok.encode(after, add_special_tokens=False)


def test_max_assistant_turns_below_one_is_refused():
    with pytest.raises(ValueError, match="max_assistant_turns must be >= 1"):
        TurnSettings(response_length=8, max_assistant_turns=0)


def test_sharded_conversations_equal_one_device(checkpoints):
    """On a (data=2, fsdp=2, tensor=2) mesh (rows over 4 shards, the shard-local cache copy) the turns are the
    single-device turns, token for token."""
    from transformers import AutoTokenizer

    from rlhf_jax.models import from_pretrained
    from rlhf_jax.parallel import make_mesh

    path = checkpoints["qwen2"]
    tok = AutoTokenizer.from_pretrained(path)
    eos = (tok.eos_token_id,)
    settings = TurnSettings(response_length=120, max_assistant_turns=3, max_tokens_per_turn=6,
                            format="test_every_turn", tools=TOOLS)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, eos_token_ids=eos, pad_token_id=tok.pad_token_id)
    prompts = _prompts(tok, 6, seed=9)
    results = []
    for mesh in (None, make_mesh(2, 2, 2)):
        model = from_pretrained(path, mesh=mesh)
        sampler = ConversationSampler.for_model(model, capacity=max(map(len, prompts)) + 120, params=params,
                                                turn_len=6, stage=16, mesh=mesh)
        trajs, _ = run_turns(sampler, _state(model), tok, prompts, settings, rollout_key(2), eos)
        results.append(trajs)
    for one, sharded in zip(*results):
        assert one.response_ids == sharded.response_ids and one.loss_mask == sharded.loss_mask
        np.testing.assert_allclose(one.logprobs, sharded.logprobs, atol=2e-5)
    assert sum(t.tool_turns for t in results[0]) >= 3


def test_over_sampling_aborts_the_last_trajectories_once_enough_are_done(checkpoints):
    """keep_fraction (verl's 1 - over_sample_rate): once that share of the trajectories is done the others are
    aborted; those done by then are what they are without it (greedy), and the row's tool arguments reach its
    calls."""
    from transformers import AutoTokenizer

    from rlhf_jax.agents.turns import tool_reply
    from rlhf_jax.models import from_pretrained

    path = checkpoints["llama"]
    model = from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    eos = (tok.eos_token_id,)
    tagged = Tool(STUB, "length, checksum and the row's tag", {"type": "object"},
                  lambda text, tag: (_stub(text) + tag, float(len(text))), row_args=("tag",))
    settings = TurnSettings(response_length=200, max_assistant_turns=6, max_user_turns=5, max_tokens_per_turn=5,
                            format="test_every_turn", tools=(tagged,))
    params = SamplingParams(max_new_tokens=settings.turn_len, temperature=0.0, eos_token_ids=eos,
                            pad_token_id=tok.pad_token_id)
    prompts = _prompts(tok, 8, seed=5)
    sampler = ConversationSampler.for_model(model, capacity=max(map(len, prompts)) + settings.response_length,
                                            params=params, turn_len=settings.turn_len, stage=16)

    def run(keep: float):
        rewards = [[] for _ in prompts]
        replies = [tool_reply(settings, {STUB: {"create_kwargs": {"tag": f"#{i}"}}}, rewards[i])
                   for i in range(len(prompts))]
        trajs, _ = run_turns(sampler, _state(model), tok, prompts, settings, rollout_key(0), eos, replies=replies,
                             keep_fraction=keep)
        return trajs, rewards

    full, full_rewards = run(1.0)
    cut, _ = run(0.25)
    assert not any(t.aborted for t in full) and len({t.turns for t in full}) > 1  # they end at different turns
    kept = [i for i, t in enumerate(cut) if not t.aborted]
    assert int(0.25 * len(prompts)) <= len(kept) < len(prompts)
    for i in kept:
        assert cut[i].response_ids == full[i].response_ids
    for i, t in enumerate(full):
        if t.tool_turns:  # each call saw its own row's tag, and its reward was collected
            assert f"#{i}" in tok.decode(t.response_ids) and len(full_rewards[i]) == t.tool_turns
