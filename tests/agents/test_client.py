"""The OpenAI-style client: an agent written against ``client.chat.completions.create`` runs on the in-process
sampler; the recorded ids and log-probs are what the sampler produced, and the episode is one token sequence."""

from __future__ import annotations

import json

import numpy as np

from rlhf_jax.agents.client import ChatClient, assistant_message
from rlhf_jax.agents.tools import get_tool
from rlhf_jax.rollout import SamplingParams, generate, rollout_key
from rlhf_jax.rollout.conversation_sampler import ConversationSampler

from .test_turns import _state


def agent(client, question: str, rounds: int = 3) -> list[dict]:
    """A small agent: ask, run any calculator call, otherwise ask for more, a few rounds."""
    tools = [get_tool("calculator").schema()]
    messages = [{"role": "user", "content": question}]
    for r in range(rounds):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=6)
        message = reply.choices[0].message
        messages.append({"role": "assistant", "content": message.content})
        if message.tool_calls:
            for call in message.tool_calls:
                result = get_tool(call.function.name).fn(**json.loads(call.function.arguments))
                messages.append({"role": "tool", "content": result, "tool_call_id": call.id})
        else:
            messages.append({"role": "user", "content": f"Round {r}: go on."})
    return messages


def _qwen2_sampler(checkpoints, temperature: float):
    """(model, tokenizer, eos ids, a conversation sampler of 6-token turns) on the tiny Qwen2 checkpoint."""
    from transformers import AutoTokenizer

    from rlhf_jax.models import from_pretrained

    path = checkpoints["qwen2"]
    model = from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    eos = (tok.eos_token_id,)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, eos_token_ids=eos, pad_token_id=tok.pad_token_id)
    return model, tok, eos, ConversationSampler.for_model(model, capacity=400, params=params, turn_len=6, stage=32)


def test_agent_calls_are_recorded_exactly_and_form_one_sequence(checkpoints):
    model, tok, eos, sampler = _qwen2_sampler(checkpoints, temperature=0.0)
    client = ChatClient(sampler, _state(model), tok, rollout_key(0), eos_token_ids=eos)
    agent(client, "What is 12 times 7?")

    assert len(client.calls) == 3 and all(c.reused_prefix for c in client.calls[1:])
    for call in client.calls:  # the sampler's own greedy tokens and log-probs for that prompt
        ref = generate(model, [call.prompt_ids], max_new_tokens=6, temperature=0.0, eos_token_ids=eos,
                       pad_token_id=tok.pad_token_id)
        assert call.response_ids == ref.tokens[0]
        np.testing.assert_allclose(call.logprobs, ref.logprobs[0], atol=2e-5)
    prompt, ids, mask, logps = client.trajectory()
    last = client.calls[-1]
    assert prompt + ids == last.prompt_ids + last.response_ids  # one sequence, earlier tokens kept as sampled
    assert sum(mask) == sum(len(c.response_ids) for c in client.calls) and len(mask) == len(ids) == len(logps)
    sampled = [t for t, m in zip(ids, mask) if m]
    assert sampled == [t for c in client.calls for t in c.response_ids]


def test_tool_calls_come_back_in_openai_form():
    """Hermes blocks in the sampled text become ``tool_calls`` entries; the text stays the content."""
    text = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    message = assistant_message(text, prefix="call_1")
    assert message.content == text and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert (call.id, call.type, call.function.name) == ("call_1_0", "function", "calculator")
    assert json.loads(call.function.arguments) == {"expression": "12*7"}
    assert assistant_message("no calls here").tool_calls is None


def test_clients_on_threads_are_sampled_in_batches_and_draw_what_they_draw_alone(checkpoints):
    """Six agents on six threads share a broker: their calls are sampled together (fewer batches than calls), and
    every recorded call equals the one the same client makes alone (row ids keep the draws apart)."""
    import threading

    from rlhf_jax.agents.broker import SamplerBroker

    model, tok, eos, sampler = _qwen2_sampler(checkpoints, temperature=1.0)
    state, key = _state(model), rollout_key(3)
    questions = [f"What is {a} times {b}?" for a, b in [(12, 7), (3, 45), (120, 9), (8, 8), (71, 2), (6, 300)]]

    def clients(broker=None):
        return [ChatClient(sampler, state, tok, key, eos_token_ids=eos, row_id=i, broker=broker)
                for i in range(len(questions))]

    alone = clients()
    for client, q in zip(alone, questions):
        agent(client, q)
    broker = SamplerBroker(sampler, state, key)
    together = clients(broker)
    start = threading.Barrier(len(questions))
    errors = []

    def run(client, q):
        try:
            start.wait()
            agent(client, q)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c, q)) for c, q in zip(together, questions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert broker.calls == 3 * len(questions) and broker.batches < broker.calls
    for a, b in zip(alone, together):
        assert [c.prompt_ids for c in a.calls] == [c.prompt_ids for c in b.calls]
        assert [c.response_ids for c in a.calls] == [c.response_ids for c in b.calls]
        for ca, cb in zip(a.calls, b.calls):  # float32 over other batch shapes: the last bits move (seen 2e-5)
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-4)
