"""The trainer's multi-turn rollout (``actor_rollout_ref.rollout.multi_turn.enable``): a prompt batch becomes a
``RolloutBatch`` whose responses hold the assistant turns and the tool responses between them.

``response_mask`` marks the sampled tokens (trained), ``response_valid`` every response token (the attention
mask's response part). Runs the turn loop of ``agents.turns`` on a ``ConversationSampler`` over the actor's
weights (one program, no copy), on the training mesh, in one process. Metrics go under ``multi_turn/``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from jax.sharding import Mesh

from rlhf_jax.agents.settings import turn_settings
from rlhf_jax.agents.turns import Trajectory, TurnTimings, run_turns
from rlhf_jax.data import PromptBatch
from rlhf_jax.rollout.conversation_sampler import ConversationSampler
from rlhf_jax.rollout.decode import RolloutBatch
from rlhf_jax.rollout.params import SamplingParams
from rlhf_jax.train.batching import to_global

# Tokens a prompt's new tokens are appended in at most (the staging width of the conversation caches).
STAGE = 64
# The end marker of a tool call per parser: a turn stops right after it (EOS stops it too).
END_MARKERS = {"hermes": "</tool_call>"}


def stop_sequences(tokenizer: Any, fmt: str) -> list[list[int]]:
    """The end marker's token ids, as the tokenizer spells it alone (a special token: one id)."""
    marker = END_MARKERS.get(fmt)
    return [list(tokenizer.encode(marker, add_special_tokens=False))] if marker else []


class MultiTurnRollout:
    """Multi-turn rollouts for one trainer: settings from the config, one conversation sampler per sampling setting."""

    def __init__(self, cfg, graphdef, model_config, tokenizer, mesh: Mesh, rules, prompt_length: int):
        mt = cfg.actor_rollout_ref.rollout.multi_turn
        self.enabled = bool(mt.enable)
        self.settings = turn_settings(mt, int(cfg.actor_rollout_ref.rollout.response_length))
        self.graphdef, self.model_config, self.tok = graphdef, model_config, tokenizer
        self.mesh, self.rules = mesh, rules
        self.capacity = int(prompt_length) + self.settings.response_length
        self.stops = stop_sequences(tokenizer, self.settings.format)
        self._samplers: dict[SamplingParams, ConversationSampler] = {}

    def tool_schemas(self) -> list[dict]:
        return [t.schema() for t in self.settings.tools]

    def sampler(self, sampling: SamplingParams) -> ConversationSampler:
        key = sampling.static_key()
        if key not in self._samplers:
            self._samplers[key] = ConversationSampler(
                self.graphdef, self.model_config, capacity=self.capacity, params=sampling,
                turn_len=self.settings.turn_len, stop_sequences=self.stops, stage=STAGE, mesh=self.mesh,
                rules=self.rules)
        return self._samplers[key]

    def rollout(self, params: Any, pb: PromptBatch, sampling: SamplingParams, key) -> tuple[RolloutBatch, dict]:
        """``sampling.n`` trajectories per prompt (prompt-major), as a global ``RolloutBatch``, and the metrics."""
        n = sampling.n
        mask = pb.attention_mask.astype(bool)
        prompts = [pb.input_ids[b][mask[b]].tolist() for b in range(len(pb)) for _ in range(n)]
        start = time.perf_counter()
        trajs, timings = run_turns(self.sampler(sampling), params, self.tok, prompts, self.settings, key,
                                   sampling.eos_token_ids)
        seconds = time.perf_counter() - start
        arrays = self._arrays(pb, trajs, sampling)
        batch = RolloutBatch(**{k: to_global(self.mesh, v) for k, v in arrays.items()})
        return batch, metrics(trajs, timings, seconds)

    def _arrays(self, pb: PromptBatch, trajs: list[Trajectory], sampling: SamplingParams) -> dict[str, np.ndarray]:
        N, R = len(trajs), self.settings.response_length
        out = {"prompts": np.repeat(pb.input_ids.astype(np.int32), sampling.n, 0),
               "prompt_mask": np.repeat(pb.attention_mask.astype(np.int32), sampling.n, 0),
               "responses": np.full((N, R), sampling.pad_token_id, np.int32),
               "response_mask": np.zeros((N, R), np.int32), "logprobs": np.zeros((N, R), np.float32),
               "finished": np.zeros((N,), bool), "response_valid": np.zeros((N, R), np.int32)}
        for i, t in enumerate(trajs):
            r = len(t.response_ids)
            out["responses"][i, :r] = t.response_ids
            out["response_mask"][i, :r] = t.loss_mask
            out["logprobs"][i, :r] = t.logprobs
            out["response_valid"][i, :r] = 1
            out["finished"][i] = t.finished
        return out


def metrics(trajs: list[Trajectory], timings: TurnTimings, seconds: float) -> dict[str, float]:
    """``multi_turn/``: per-trajectory means and maxima, tool latency, the untrained share, device idle time."""
    out: dict[str, float] = {}
    per = {"num_turns": [t.turns for t in trajs], "tool_calls": [t.stats.calls for t in trajs],
           "tool_errors": [t.stats.errors for t in trajs], "tool_timeouts": [t.stats.timeouts for t in trajs]}
    for name, values in per.items():
        out[f"multi_turn/{name}/mean"] = float(np.mean(values))
        out[f"multi_turn/{name}/max"] = float(np.max(values))
    calls = sum(t.stats.calls for t in trajs)
    out["multi_turn/tool_latency_s"] = sum(t.stats.seconds for t in trajs) / max(calls, 1)  # per call
    tokens = sum(len(t.response_ids) for t in trajs)
    out["multi_turn/masked_token_fraction"] = (tokens - sum(sum(t.loss_mask) for t in trajs)) / max(tokens, 1)
    # turn-synchronous: the device is idle while the host runs the tools
    out["multi_turn/device_idle_s"] = timings.tool_wait_s
    out["multi_turn/device_idle_fraction"] = timings.tool_wait_s / max(seconds, 1e-9)
    return out
