"""The multi-turn tool-calling rollout: decode a turn, run the tool calls, append the responses, go on from the cache.

Turn-synchronous over the batch: every live trajectory decodes its turn in one device loop
(``ConversationSampler.decode``: until EOS, a tool-call end marker or its token limit); then the host parses each
turn's text, runs every trajectory's tool calls at once (the device waits for the slowest call, never for the
sum), renders the responses with the chat template (``render.tool_suffix_ids``) and appends them to the device
caches, which prefill only those new tokens. A trajectory ends when a turn has no tool call, at
``max_assistant_turns`` / ``max_user_turns``, or when its response budget (assistant and tool tokens together,
``response_length``) cannot hold the tool response and one more token.

Tokens are kept exactly as sampled; tool tokens carry loss mask 0 and log-prob 0.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import jax

from rlhf_jax.agents.executor import ToolResult, ToolStats, run_tool_calls, tool_message
from rlhf_jax.agents.render import tool_suffix_ids
from rlhf_jax.agents.tool_calls import parse_tool_calls
from rlhf_jax.agents.tools import Tool
from rlhf_jax.config.names import TOOL_RESPONSE_TRUNCATION
from rlhf_jax.parallel import groups
from rlhf_jax.parallel.hosts import all_rows


@dataclasses.dataclass(frozen=True)
class TurnSettings:
    """How a multi-turn rollout runs (verl's ``rollout.multi_turn`` keys; see the config schema)."""

    response_length: int  # tokens after the prompt, assistant and tool tokens together
    max_assistant_turns: int = 5
    max_user_turns: int = 5  # tool-response turns
    max_tokens_per_turn: int | None = None  # None: whatever is left of response_length
    format: str = "hermes"
    tool_timeout_s: float = 30.0
    tools: tuple[Tool, ...] = ()
    max_parallel_calls: int = 1  # calls run per turn (verl's default); the rest of a turn's calls are dropped
    max_tool_response_length: int | None = 256  # characters of a tool's output the model sees; None = all
    tool_response_truncate_side: str = "middle"  # left: keep the start, right: keep the end, middle: both ends

    def __post_init__(self):
        if self.max_assistant_turns < 1:
            raise ValueError(f"max_assistant_turns must be >= 1, got {self.max_assistant_turns}")
        if self.tool_response_truncate_side not in TOOL_RESPONSE_TRUNCATION:
            raise ValueError(f"tool_response_truncate_side must be left, right or middle, got "
                             f"{self.tool_response_truncate_side!r}")

    @property
    def turn_len(self) -> int:
        return self.response_length if self.max_tokens_per_turn is None else min(self.max_tokens_per_turn,
                                                                                   self.response_length)


@dataclasses.dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)  # 1: sampled (trained), 0: tool response
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0  # assistant turns
    tool_turns: int = 0
    stats: ToolStats = dataclasses.field(default_factory=ToolStats)
    turn_rewards: list[float] = dataclasses.field(default_factory=list)  # an environment's reward per turn
    reward_ends: list[int] = dataclasses.field(default_factory=list)  # per turn_rewards entry: its turn's last index
    finished: bool = False  # the last turn ended with a stop token (not at a length limit)
    done: bool = False
    aborted: bool = False  # cut off by over-sampling (``run_turns``' ``keep_fraction``): trained as an empty row
    # (prompt + response tokens, sparse layers, K): the experts the sampler routed each token to (R3), or None
    routes: Any = None

    def extend(self, ids: Sequence[int], sampled: bool, logprobs: Sequence[float] | None = None) -> None:
        self.response_ids += [int(t) for t in ids]
        self.loss_mask += [int(sampled)] * len(ids)
        self.logprobs += [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids)


@dataclasses.dataclass
class TurnTimings:
    decode_s: float = 0.0
    append_s: float = 0.0
    tool_wait_s: float = 0.0  # wall time the device waited for tools (turn-synchronous: it is idle then)


def truncate(text: str, limit: int | None, side: str) -> str:
    """At most ``limit`` characters of a tool's output (plus a marker), cut as ``side`` says."""
    if limit is None or len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    return text[:limit // 2] + "...(truncated)..." + text[len(text) - (limit - limit // 2):]


@dataclasses.dataclass
class Reply:
    """What follows an assistant turn: messages rendered after it (tool results, an environment's observation)."""

    messages: list[dict]
    done: bool = False  # the trajectory ends after this turn (the messages are not appended)
    reward: float = 0.0  # an environment's reward for the turn
    results: list[ToolResult] = dataclasses.field(default_factory=list)
    parse_errors: int = 0


ReplyFn = Callable[[str, bool], "Reply | None"]  # (the turn's text, it is the last allowed turn) -> reply or None


def tool_reply(settings: TurnSettings, row_kwargs: dict | None = None,
               rewards: list[float] | None = None) -> ReplyFn:
    """Tool calling: the turn's calls run (at most ``max_parallel_calls``); no call ends the trajectory, and so does
    the last allowed turn (its calls would have no reader). ``row_kwargs``: the row's arguments per tool (verl's
    ``tools_kwargs``); ``rewards`` collects the calls' tool rewards."""
    tools = {t.name: t for t in settings.tools}

    def reply(text: str, last_turn: bool) -> Reply | None:
        parsed = parse_tool_calls(text, settings.format)
        if (not parsed.calls and not parsed.errors) or last_turn:
            return None
        calls = parsed.calls[:settings.max_parallel_calls]
        results = run_tool_calls(calls, settings.tool_timeout_s, tools=tools, row_kwargs=row_kwargs) if calls else []
        if rewards is not None:
            rewards.extend(r.reward for r in results if r.reward is not None)
        results = [dataclasses.replace(r, content=truncate(r.content, settings.max_tool_response_length,
                                                           settings.tool_response_truncate_side)) for r in results]
        messages = [tool_message(r) for r in results]
        messages += [{"role": "tool", "name": "error", "content": f"Error: {e}"} for e in parsed.errors]
        return Reply(messages, results=results, parse_errors=len(parsed.errors))

    return reply


def run_turns(sampler, state: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], settings: TurnSettings,
              key: jax.Array, eos_token_ids: Sequence[int], row_ids: Sequence[int] | None = None,
              replies: Sequence[ReplyFn] | None = None,
              keep_fraction: float = 1.0) -> tuple[list[Trajectory], TurnTimings]:
    """Multi-turn rollouts of ``prompts`` (token ids, the generation prompt included) on a ``ConversationSampler``.

    ``replies`` answer each row's turns (default: ``tool_reply(settings)`` for every row; environments:
    ``agents.environment.environment_reply``); they run at the same time for all rows. ``row_ids`` key each
    trajectory's random stream (default: its index in the batch of every process's prompts); the batch is padded
    with empty rows to the sampler's data-parallel shard count.

    Over several processes each runs its own prompts (as many on every process) and their replies; the turns
    end when every process's trajectories are done, so that all run the same programs.

    ``keep_fraction`` < 1 (verl's ``rollout.over_sample_rate`` r: 1 - r): once that share of every process's
    trajectories is done (``int(total * keep_fraction)``, checked after each turn), the others are aborted.
    """
    trajs = [Trajectory(prompt_ids=[int(t) for t in p]) for p in prompts]
    real = len(trajs)
    shards = sampler.shard_count(state)
    rows = -(-real // shards) * shards
    first = groups.process_index() * real  # this process's rows come after the earlier processes' ones
    ids = list(row_ids) if row_ids is not None else list(range(first, first + real))
    ids += [0] * (rows - real)
    eos = {int(e) for e in eos_token_ids}
    timings = TurnTimings()
    pad = [[] for _ in range(rows - real)]
    replies = list(replies) if replies is not None else [tool_reply(settings)] * real

    t0 = time.perf_counter()
    conv = sampler.start(state, rows)
    conv = sampler.append(state, conv, [t.prompt_ids for t in trajs] + pad)
    timings.append_s += time.perf_counter() - t0
    with ThreadPoolExecutor(max_workers=max(1, real)) as pool:
        for turn in range(settings.max_assistant_turns):
            if all_rows([all(t.done for t in trajs)]).all():
                break
            limit = [0 if t.done else min(settings.turn_len, settings.response_length - len(t.response_ids))
                     for t in trajs] + [0] * len(pad)
            start = [len(t.response_ids) for t in trajs] + [0] * len(pad)
            t0 = time.perf_counter()
            conv, out = sampler.decode(state, conv, limit, start, ids, key)
            timings.decode_s += time.perf_counter() - t0

            texts: dict[int, tuple[str, bool]] = {}
            for i, traj in enumerate(trajs):
                if traj.done:
                    continue
                tokens = out.tokens[i, :out.count[i]].tolist()
                traj.extend(tokens, True, out.logprobs[i, :out.count[i]].tolist())
                traj.turns += 1
                traj.finished = bool(out.stopped[i]) and bool(tokens) and tokens[-1] in eos
                last_turn = (turn + 1 >= settings.max_assistant_turns or traj.tool_turns >= settings.max_user_turns
                             or len(traj.response_ids) >= settings.response_length)
                texts[i] = (tokenizer.decode(tokens, skip_special_tokens=False), last_turn)

            t0 = time.perf_counter()
            futures = {i: pool.submit(replies[i], text, last) for i, (text, last) in texts.items()}
            answers = {i: f.result() for i, f in futures.items()}
            timings.tool_wait_s += time.perf_counter() - t0

            new_rows: list[list[int]] = [[] for _ in range(rows)]
            for i, reply in answers.items():
                traj = trajs[i]
                if reply is not None:
                    traj.stats.add(reply.results, reply.parse_errors)
                    traj.turn_rewards.append(float(reply.reward))
                    traj.reward_ends.append(len(traj.response_ids) - 1)  # the turn it answers ends here
                if reply is None or reply.done or texts[i][1]:
                    traj.done = True
                    continue
                suffix = tool_suffix_ids(tokenizer, reply.messages, traj.response_ids[-1] in eos)
                if len(traj.response_ids) + len(suffix) >= settings.response_length:
                    traj.done = True  # no room for the response and another assistant token
                    continue
                traj.extend(suffix, False)
                traj.tool_turns += 1
                new_rows[i] = suffix
            if keep_fraction < 1.0 and _enough_done(trajs, keep_fraction):
                for t in trajs:
                    t.aborted = not t.done
                break
            t0 = time.perf_counter()  # (nothing to append anywhere: no program runs)
            conv = sampler.append(state, conv, new_rows)
            timings.append_s += time.perf_counter() - t0
    for t in trajs:
        t.done = True
    if getattr(sampler, "record_routes", False):  # every token was fed through the cache: each has its route
        routes = sampler.routes(conv)
        for i, t in enumerate(trajs):
            t.routes = routes[i, :len(t.prompt_ids) + len(t.response_ids)]
    return trajs, timings


def _enough_done(trajs: list[Trajectory], keep_fraction: float) -> bool:
    """Whether ``int(total * keep_fraction)`` of every process's trajectories are done (verl's target count)."""
    counts = all_rows([[sum(t.done for t in trajs), len(trajs)]]).reshape(-1, 2).sum(axis=0)
    return int(counts[0]) >= int(int(counts[1]) * keep_fraction)
