"""The trainer's multi-turn rollout (``actor_rollout_ref.rollout.multi_turn.enable``): a prompt batch becomes a
``RolloutBatch`` whose responses hold the assistant turns and the tool responses between them.

``response_mask`` marks the sampled tokens (trained), ``response_valid`` every response token (the attention
mask's response part). Runs the turn loop of ``agents.turns`` on a ``ConversationSampler`` over the actor's
weights (one program, no copy), on the sampling mesh (the rollout devices' under ``mesh.rollout_devices``, else the
training mesh), in one process; the batch it returns is on the training mesh. Metrics go under ``multi_turn/``.

Three drivers: tool calls (the data's prompts; the reward manager scores), an environment (its first observation
is the prompt; its summed rewards are the scores) and a workflow (a user's agent on an OpenAI-style client per
task; its episode, one token sequence, is trained with the reward it returns).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
from jax.sharding import Mesh

from rlhf_jax.agents.broker import SamplerBroker
from rlhf_jax.agents.client import ChatClient
from rlhf_jax.agents.environment import environment_reply, load_environment, make_environments
from rlhf_jax.agents.settings import KEY, turn_settings
from rlhf_jax.agents.interactions import Interactions, interaction_reply, read_config
from rlhf_jax.agents.turns import Trajectory, TurnTimings, run_turns, tool_reply
from rlhf_jax.agents.workflows import load_workflow
from rlhf_jax.data import PromptBatch
from rlhf_jax.data.prompts import render_prompt
from rlhf_jax.rollout.conversation_sampler import ConversationSampler
from rlhf_jax.rollout.decode import RolloutBatch
from rlhf_jax.rollout.params import SamplingParams
from rlhf_jax.parallel import groups
from rlhf_jax.parallel.hosts import all_rows, to_global

# Tokens a prompt's new tokens are appended in at most (the staging width of the conversation caches).
STAGE = 64
# The end marker of a tool call per parser: a turn stops right after it (EOS stops it too).
END_MARKERS = {"hermes": "</tool_call>"}


def stop_sequences(tokenizer: Any, fmt: str) -> list[list[int]]:
    """The end marker's token ids, as the tokenizer spells it alone (a special token: one id)."""
    marker = END_MARKERS.get(fmt)
    return [list(tokenizer.encode(marker, add_special_tokens=False))] if marker else []


def multi_turn_rollout(cfg, graphdef, model_config, tokenizer, mesh: Mesh, rules,
                       sampling_mesh: Mesh | None = None) -> "MultiTurnRollout | None":
    """The run's multi-turn rollout, or None when ``rollout.multi_turn.enable`` is off (the sampler's own)."""
    if not cfg.actor_rollout_ref.rollout.multi_turn.enable:
        return None
    return MultiTurnRollout(cfg, graphdef, model_config, tokenizer, mesh, rules, sampling_mesh=sampling_mesh)


class MultiTurnRollout:
    """Multi-turn rollouts for one trainer: settings from the config, one conversation sampler per sampling setting."""

    def __init__(self, cfg, graphdef, model_config, tokenizer, mesh: Mesh, rules, sampling_mesh: Mesh | None = None):
        """``mesh``: the training mesh, where the returned batch lives; ``sampling_mesh``: where the conversation
        sampler runs (None: ``mesh``)."""
        mt = cfg.actor_rollout_ref.rollout.multi_turn
        self.enabled = bool(mt.enable)
        self.settings = turn_settings(mt, int(cfg.actor_rollout_ref.rollout.response_length))
        self.graphdef, self.model_config, self.tok = graphdef, model_config, tokenizer
        self.mesh, self.rules, self.sampling_mesh = mesh, rules, sampling_mesh or mesh
        self.prompt_length = int(cfg.data.max_prompt_length)
        self.capacity = self.prompt_length + self.settings.response_length
        self.stops = stop_sequences(tokenizer, self.settings.format)
        self._samplers: dict[SamplingParams, ConversationSampler] = {}
        self.env_cls = load_environment(mt.environment, f"{KEY}.environment") if mt.environment else None
        self.named_envs = _plain(mt.environments) or {}  # tasks naming one of these play it (ROLL's env tags)
        self.workflow = load_workflow(mt.workflow, f"{KEY}.workflow") if mt.workflow else None
        self.workflow_args = dict(mt.workflow_args or {})  # every task gets them as task["workflow_args"]
        path = mt.get("interaction_config_path")
        self.interactions = Interactions(read_config(path)) if path else None
        self._extra_info: list[dict] | None = None  # the last rollout's per-row extra_info for the reward function
        self.data_cfg = cfg.data
        self._scores: np.ndarray | None = None  # the last rollout's environment scores, until taken
        self.per_turn_rewards = bool(mt.per_turn_rewards)
        # verl's: abort a training rollout's last trajectories once 1 - rate of them are done
        self.over_sample_rate = float(cfg.actor_rollout_ref.rollout.over_sample_rate or 0.0)
        self._token_rewards: np.ndarray | None = None

    def tool_schemas(self) -> list[dict]:
        return [t.schema() for t in self.settings.tools]

    def sampler(self, sampling: SamplingParams) -> ConversationSampler:
        key = sampling.static_key()
        if key not in self._samplers:
            self._samplers[key] = ConversationSampler(
                self.graphdef, self.model_config, capacity=self.capacity, params=sampling,
                turn_len=self.settings.turn_len, stop_sequences=self.stops, stage=STAGE, mesh=self.sampling_mesh,
                rules=self.rules)
        return self._samplers[key]

    def rollout(self, params: Any, pb: PromptBatch, sampling: SamplingParams, key,
                training: bool = False) -> tuple[RolloutBatch, dict]:
        """``sampling.n`` trajectories per prompt (prompt-major), as a global ``RolloutBatch``, and the metrics.
        ``training``: a training rollout (over-sampling aborts only those, as verl's)."""
        arrays, out = self.play(params, pb, sampling, key, training)
        return RolloutBatch(**{k: to_global(self.mesh, v) for k, v in arrays.items()}), out

    def play(self, params: Any, pb: PromptBatch, sampling: SamplingParams, key,
             training: bool = False) -> tuple[dict[str, np.ndarray], dict]:
        """``sampling.n`` trajectories per prompt (prompt-major) as this process's arrays of a ``RolloutBatch``,
        and the metrics; the environment's scores and per-turn rewards wait to be taken."""
        n = sampling.n
        self._extra_info = None
        mask = pb.attention_mask.astype(bool)
        prompts = [pb.input_ids[b][mask[b]].tolist() for b in range(len(pb)) for _ in range(n)]
        replies = None
        envs_on = self.env_cls is not None or bool(self.named_envs)
        if envs_on:  # the environments' first observations are the prompts
            tasks = [{"ground_truth": gt, **dict(extra or {})} for gt, extra in zip(pb.ground_truth, pb.extra_info)
                     for _ in range(n)]
            envs, observations = make_environments(self.env_cls, tasks, self.named_envs, f"{KEY}.environments")
            prompts = [self._render(o) for o in observations]
            replies = [environment_reply(e) for e in envs]
        start = time.perf_counter()
        interaction_metric = None
        if self.workflow is not None:
            trajs, rewards, per_batch = self._run_workflow(params, pb, sampling, key)
            prompts, timings = [t.prompt_ids for t in trajs], TurnTimings()
        else:
            extra = None
            if replies is None:  # tools and interactions: each row's own tool arguments, scores and rewards
                replies, extra = self._row_replies(pb, n)
            keep = 1.0 - self.over_sample_rate if training else 1.0
            trajs, timings = run_turns(self.sampler(sampling), params, self.tok, prompts, self.settings, key,
                                       sampling.eos_token_ids, replies=replies, keep_fraction=keep)
            rewards = [sum(t.turn_rewards) for t in trajs] if envs_on else None
            if extra is not None:  # the reward function reads them in extra_info, as verl's does
                extra = [{"turn_scores": [], "tool_rewards": []} if t.aborted else e for e, t in zip(extra, trajs)]
                self._extra_info = extra  # (an aborted trajectory: nothing, as verl's padding request)
                if self.interactions is not None:
                    last = np.asarray([e["turn_scores"][-1] if e["turn_scores"] else 0.0 for e in extra], np.float32)
                    interaction_metric = float(all_rows(last).mean())
        seconds = time.perf_counter() - start
        arrays = self._arrays(prompts, trajs, sampling)
        out = metrics(trajs, timings, seconds)
        if self.workflow is not None:
            out["multi_turn/calls_per_batch"] = per_batch  # the workflow clients' calls sampled together
        if rewards is not None:  # an environment's or a workflow's rewards are the scores
            self._scores = np.asarray(rewards, np.float32)
            out["multi_turn/env_reward/mean"] = float(all_rows(self._scores).mean())  # every process's
        if interaction_metric is not None:  # each trajectory's last interaction score, over every process
            out["multi_turn/interaction_score/mean"] = interaction_metric
        if self.per_turn_rewards:
            self._token_rewards = per_turn_rewards(trajs, self.settings.response_length)
        return arrays, out

    def _row_replies(self, pb: PromptBatch, n: int) -> tuple[list, list[dict]]:
        """Each row's replies: its tool calls with the row's tool arguments (verl's ``extra_info.tools_kwargs``),
        and the interaction its prompt names when there are interactions (tools first); and per row the lists its
        ``turn_scores`` and ``tool_rewards`` go to."""
        specials = [t for t in getattr(self.tok, "all_special_tokens", []) if t]

        def clean(text: str) -> str:
            for token in specials:
                text = text.replace(token, "")
            return text

        replies, extra = [], []
        for b in range(len(pb)):
            info = pb.extra_info[b] if isinstance(pb.extra_info[b], dict) else {}
            picked = self.interactions.pick(info, b) if self.interactions is not None else None
            raw = pb.raw_prompt[b]
            for _ in range(n):
                row = {"turn_scores": [], "tool_rewards": []}
                tools = tool_reply(self.settings, info.get("tools_kwargs"), row["tool_rewards"]) \
                    if self.settings.tools else None
                if picked is not None:
                    messages = [dict(m) for m in raw] if isinstance(raw, (list, tuple)) else [
                        {"role": "user", "content": str(raw)}]
                    tools = interaction_reply(self.interactions, *picked, messages, tools, clean, row["turn_scores"])
                replies.append(tools)
                extra.append(row)
        return replies, extra

    def take_extra_info(self) -> list[dict] | None:
        """The last rollout's per-row additions to the reward function's extra_info (``turn_scores``,
        ``tool_rewards``), once (None where tools and interactions drive no trajectory)."""
        extra, self._extra_info = self._extra_info, None
        return extra

    def _run_workflow(self, params: Any, pb: PromptBatch, sampling: SamplingParams,
                      key) -> tuple[list[Trajectory], list[float], float]:
        """Every task's workflow on its own client, at the same time (their calls batched by one broker); each episode
        as one trajectory; and the mean number of calls per sampled batch."""
        n, R = sampling.n, self.settings.response_length
        tasks = [{"prompt": raw, "ground_truth": gt, **dict(extra or {}), "workflow_args": dict(self.workflow_args)}
                 for raw, gt, extra in zip(pb.raw_prompt, pb.ground_truth, pb.extra_info) for _ in range(n)]
        sampler = self.sampler(sampling)
        # the episodes' concurrent calls are sampled together; over several processes in rounds all of them join
        broker = SamplerBroker(sampler, params, key, lockstep=groups.process_count() > 1)
        first = groups.process_index() * len(tasks)  # this process's rows come after the earlier processes' ones
        clients = [ChatClient(sampler, params, self.tok, key, eos_token_ids=sampling.eos_token_ids,
                              max_tokens=self.settings.turn_len, parser=self.settings.format, row_id=first + i,
                              broker=broker) for i in range(len(tasks))]

        def run(i: int) -> float:
            try:
                return float(self.workflow(clients[i], tasks[i]))
            except ValueError:
                raise
            except Exception as e:  # noqa: BLE001 - the user's code: one line naming the key
                raise ValueError(f"{KEY}.workflow raised {type(e).__name__}: {e}") from None

        rewards = broker.run_episodes([functools.partial(run, i) for i in range(len(tasks))], min(len(tasks), 16))
        trajs = []
        for client in clients:
            prompt, ids, mask, logps = client.trajectory()
            if len(prompt) > self.prompt_length:
                raise ValueError(f"{KEY}.workflow: an episode's first prompt is {len(prompt)} tokens, longer than "
                                 f"data.max_prompt_length={self.prompt_length}")
            routes = client.routes()
            t = Trajectory(prompt_ids=prompt, response_ids=ids[:R], loss_mask=mask[:R], logprobs=logps[:R],
                           turns=len(client.calls), done=True,
                           routes=None if routes is None else routes[:len(prompt) + min(len(ids), R)])
            t.finished = len(ids) <= R and client.calls[-1].finish_reason == "stop"
            trajs.append(t)
        return trajs, rewards, broker.calls_per_batch()

    def close(self) -> None:
        """Stop the interactions' event loop (the run's end)."""
        if self.interactions is not None:
            self.interactions.close()

    def take_scores(self) -> np.ndarray | None:
        """The last rollout's environment scores (N,), once (None without an environment)."""
        scores, self._scores = self._scores, None
        return scores

    def take_token_rewards(self) -> np.ndarray | None:
        """With multi_turn.per_turn_rewards, the last rollout's per-turn rewards as token-level rewards (N, R), once."""
        rewards, self._token_rewards = self._token_rewards, None
        return rewards

    def _render(self, observation: str) -> list[int]:
        """An environment's first observation as the prompt: a user message through the chat template."""
        kwargs = {**dict(self.data_cfg.apply_chat_template_kwargs or {}),
                  **({"tools": self.tool_schemas()} if self.settings.tools else {})}
        text, special = render_prompt(observation, self.tok, "native", self.data_cfg.system_prompt or None, kwargs)
        ids = list(self.tok.encode(text, add_special_tokens=special))
        if len(ids) > self.prompt_length:
            raise ValueError(f"{KEY}.environment: the first observation is {len(ids)} tokens, longer than "
                             f"data.max_prompt_length={self.prompt_length}; raise data.max_prompt_length")
        return ids

    def _arrays(self, prompts: list[list[int]], trajs: list[Trajectory],
                sampling: SamplingParams) -> dict[str, np.ndarray]:
        N, R = len(trajs), self.settings.response_length
        P = int(all_rows([max(len(p) for p in prompts)]).max())  # every process's rows are as wide
        out = {"prompts": np.full((N, P), sampling.pad_token_id, np.int32), "prompt_mask": np.zeros((N, P), np.int32),
               "responses": np.full((N, R), sampling.pad_token_id, np.int32),
               "response_mask": np.zeros((N, R), np.int32), "logprobs": np.zeros((N, R), np.float32),
               "finished": np.zeros((N,), bool), "response_valid": np.zeros((N, R), np.int32)}
        for i, (p, t) in enumerate(zip(prompts, trajs)):
            out["prompts"][i, P - len(p):] = p
            out["prompt_mask"][i, P - len(p):] = 1
            r = 0 if t.aborted else len(t.response_ids)  # an aborted one: an empty response, as verl pads it
            out["responses"][i, :r] = t.response_ids[:r]
            out["response_mask"][i, :r] = t.loss_mask[:r]
            out["logprobs"][i, :r] = t.logprobs[:r]
            out["response_valid"][i, :r] = 1
            out["finished"][i] = t.finished and not t.aborted
        if trajs and trajs[0].routes is not None:  # R3: the experts of every token, beside it (-1 on padding)
            routes = np.full((N, P + R) + trajs[0].routes.shape[1:], -1, np.int32)
            for i, (p, t) in enumerate(zip(prompts, trajs)):
                routes[i, P - len(p):P] = t.routes[:len(p)]
                if not t.aborted:
                    routes[i, P:P + len(t.response_ids)] = t.routes[len(p):]
            out["routed_experts"] = routes
        return out


def _plain(value: Any) -> Any:
    """A ConfigDict / mapping as plain dicts (the environments read their settings as dicts)."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def per_turn_rewards(trajs: list[Trajectory], width: int) -> np.ndarray:
    """Token-level rewards (N, width): each environment reward on the last trained token of the assistant turn it
    answered (at or before the turn's end; a turn cut off by the grid gives it to the grid's last trained token),
    so each row sums to the trajectory's total. A row with no trained token gets zeros, as place_on_last_token."""
    out = np.zeros((len(trajs), width), np.float32)
    for i, t in enumerate(trajs):
        trained = np.flatnonzero(np.asarray(t.loss_mask[:width], bool))
        for end, reward in zip(t.reward_ends, t.turn_rewards):
            before = trained[trained <= end]
            if before.size:
                out[i, before[-1]] += reward
    return out


def metrics(trajs: list[Trajectory], timings: TurnTimings, seconds: float) -> dict[str, float]:
    """``multi_turn/``: per-trajectory means and maxima, tool latency and the untrained share over every process's
    trajectories; this process's device idle time."""
    out: dict[str, float] = {}
    names = ("num_turns", "tool_calls", "tool_errors", "tool_timeouts")
    rows = all_rows(np.asarray([(t.turns, t.stats.calls, t.stats.errors, t.stats.timeouts, t.stats.seconds,
                                 len(t.response_ids), sum(t.loss_mask), t.aborted) for t in trajs], np.float64))
    for j, name in enumerate(names):
        out[f"multi_turn/{name}/mean"] = float(np.mean(rows[:, j]))
        out[f"multi_turn/{name}/max"] = float(np.max(rows[:, j]))
    calls, call_seconds, tokens, trained = rows[:, 1].sum(), rows[:, 4].sum(), rows[:, 5].sum(), rows[:, 6].sum()
    out["multi_turn/tool_latency_s"] = float(call_seconds / max(calls, 1))  # per call
    out["multi_turn/masked_token_fraction"] = float((tokens - trained) / max(tokens, 1))
    out["multi_turn/aborted_fraction"] = float(rows[:, 7].mean())  # cut off by rollout.over_sample_rate
    # turn-synchronous: the device is idle while the host runs the tools
    out["multi_turn/device_idle_s"] = timings.tool_wait_s
    out["multi_turn/device_idle_fraction"] = timings.tool_wait_s / max(seconds, 1e-9)
    return out
