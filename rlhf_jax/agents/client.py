"""An OpenAI-style chat client over the in-process sampler that records what the sampler produced.

Agent code written against ``client.chat.completions.create(messages=..., tools=...)`` runs unchanged; every call
is recorded with the exact prompt token ids, the sampled token ids and their log-probs. The conversation is not
re-tokenized: when a call's rendered prompt extends the previous call's prompt and response (the agent appended
the returned message and, say, tool results), the previous tokens are kept as they were and only the new text is
tokenized, so one token sequence holds the whole episode (``trajectory()``): the sampled tokens trained, the rest
masked. A call whose prompt does not extend the previous one starts a new sequence (``reused_prefix`` False).

Each call samples its conversation on a ``ConversationSampler`` (prefilling its prompt; no cache is kept between
calls) through a ``SamplerBroker`` (agents/broker.py): clients on several threads that share one broker (a
workflow's episodes) have their concurrent calls sampled together as one batch, and a row's tokens depend only on
(key, row id, token index), so batching changes nothing a client draws. Tool calls in the reply are parsed by the sampler's format (hermes by default) into OpenAI's
``tool_calls`` entries; ``content`` is the reply's text as sampled, so appending the message as it comes back
renders the same text again.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any, Sequence

import jax

from rlhf_jax.agents.broker import SamplerBroker
from rlhf_jax.agents.tool_calls import parse_tool_calls


@dataclasses.dataclass
class RecordedCall:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS / end marker) or "length"
    reused_prefix: bool  # the prompt extends the previous call's tokens (no re-tokenization)
    routes: Any = None  # R3 (the sampler records routes): every prompt and sampled token's experts, in order


def assistant_message(content: str, parser: str = "hermes", prefix: str = "call") -> SimpleNamespace:
    """OpenAI's assistant message for sampled text: the text as ``content``, its tool calls as ``tool_calls``
    (``function.arguments`` a JSON string, as OpenAI returns them; None when there are none)."""
    calls = parse_tool_calls(content, parser).calls
    tool_calls = [SimpleNamespace(id=f"{prefix}_{i}", type="function",
                                  function=SimpleNamespace(name=c.name, arguments=json.dumps(c.arguments)))
                  for i, c in enumerate(calls)]
    return SimpleNamespace(role="assistant", content=content, tool_calls=tool_calls or None)


class ChatClient:
    """``client.chat.completions.create(messages=..., tools=...)`` over a ``ConversationSampler``; clients that
    share a ``broker`` (made for ``sampler``, ``state`` and ``key``) are sampled in batches."""

    def __init__(self, sampler, state: Any, tokenizer: Any, key: jax.Array, *, eos_token_ids: Sequence[int],
                 max_tokens: int | None = None, parser: str = "hermes", row_id: int = 0,
                 broker: SamplerBroker | None = None):
        self.sampler, self.state, self.tok, self.key = sampler, state, tokenizer, key
        self.broker = broker or SamplerBroker(sampler, state, key)
        self.eos = {int(e) for e in eos_token_ids}
        self.max_tokens = max_tokens or sampler.turn_len
        self.parser, self.row_id = parser, row_id
        self.calls: list[RecordedCall] = []
        self._ids: list[int] = []
        self._text = ""
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def _prompt_ids(self, text: str) -> tuple[list[int], bool]:
        if self._ids and text.startswith(self._text):
            return self._ids + list(self.tok.encode(text[len(self._text):], add_special_tokens=False)), True
        return list(self.tok.encode(text, add_special_tokens=False)), False

    def create(self, *, messages: list[dict], tools: list[dict] | None = None, max_tokens: int | None = None,
               **_: Any) -> SimpleNamespace:
        """One completion (n = 1); sampling settings are the sampler's (other OpenAI arguments are ignored)."""
        kwargs = {"tools": tools} if tools else {}
        text = self.tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True, **kwargs)
        prompt, reused = self._prompt_ids(text)
        limit = min(max_tokens or self.max_tokens, self.sampler.turn_len, self.sampler.capacity - len(prompt))
        if limit < 1:
            raise ValueError(f"the conversation ({len(prompt)} tokens) fills the sampler's capacity "
                             f"({self.sampler.capacity}; in training data.max_prompt_length + rollout.response_length): "
                             "raise it or shorten the episode")
        start = sum(len(c.response_ids) for c in self.calls)  # fresh draws for every call of the episode
        tokens, logprobs, stopped, routes = self.broker.sample(prompt, limit, start, self.row_id)
        finish = "stop" if stopped else "length"
        self.calls.append(RecordedCall(prompt, tokens, logprobs, finish, reused, routes))
        self._ids, self._text = prompt + tokens, text + self.tok.decode(tokens, skip_special_tokens=False)
        content = self.tok.decode([t for t in tokens if t not in self.eos], skip_special_tokens=False)
        message = assistant_message(content, self.parser, prefix=f"call_{len(self.calls)}")
        if message.tool_calls:
            finish = "tool_calls"
        return SimpleNamespace(choices=[SimpleNamespace(index=0, message=message, finish_reason=finish)],
                               usage=SimpleNamespace(prompt_tokens=len(prompt), completion_tokens=len(tokens)))

    def trajectory(self) -> tuple[list[int], list[int], list[int], list[float]]:
        """(prompt ids, response ids, loss mask, log-probs) of the episode as one sequence: the first call's prompt,
        then every later token, the sampled ones with mask 1 and their log-probs. Needs every later call to extend
        the previous one (``reused_prefix``)."""
        if not self.calls:
            raise ValueError("no calls were made")
        if not all(c.reused_prefix for c in self.calls[1:]):
            raise ValueError("a call did not extend the conversation before it: the episode is not one sequence")
        prompt = self.calls[0].prompt_ids
        ids, mask, logps = [], [], []
        for i, call in enumerate(self.calls):
            if i:
                before = len(self.calls[i - 1].prompt_ids) + len(self.calls[i - 1].response_ids)
                new = call.prompt_ids[before:]
                ids += new
                mask += [0] * len(new)
                logps += [0.0] * len(new)
            ids += call.response_ids
            mask += [1] * len(call.response_ids)
            logps += call.logprobs
        return prompt, ids, mask, logps

    def routes(self) -> Any:
        """R3: the experts of every token of ``trajectory()``'s sequence (its prompt, then the rest), as the sampler
        routed them, or None when it records none. The last call's: its prompt holds every earlier token, routed in
        the same context (attention is causal), and its reply follows."""
        self.trajectory()  # the episode is one sequence
        return self.calls[-1].routes
