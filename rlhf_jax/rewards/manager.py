"""Scoring a batch of responses with rule-based or custom functions (reward_model.reward_manager).

``naive`` runs the function in this process (each call in a thread with a
timeout, ``num_workers`` at a time; ``sys.exit`` and ``os._exit`` fail only the call); ``prime`` runs it in a pool of worker
processes, replacing any worker that hangs past the timeout; ``batch`` calls it
once per batch as verl's batch manager does, with keyword lists
(``data_sources=, solution_strs=, ground_truths=, extra_infos=``) and one result
per response back; ``dapo`` is ``naive`` (verl's DAPO manager adds the overlong
penalty, which ``reward_model.overlong_buffer`` applies with any manager). A call that
raises, returns something unusable, or times out scores 0.0 and is counted
(``reward/num_errors``, ``reward/num_timeouts``, and running totals); with
``fail_on_error`` it stops the run instead, naming the row.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlhf_jax.config.names import REWARD_MANAGERS
from rlhf_jax.rewards.custom import ScoreSpec, check_reward_file, normalize_result, spec_from_config
from rlhf_jax.rewards.pool import Outcome, ProcessPool, guard_os_exit, run_in_threads

log = logging.getLogger(__name__)



class RewardFunctionError(RuntimeError):
    """A reward call failed and reward_model.fail_on_error is set."""


@dataclasses.dataclass
class RewardResult:
    scores: np.ndarray  # float32 [N], including any overlong penalty
    extras: dict[str, np.ndarray]  # float32 [N] per extra metric, NaN where a row did not report it
    num_errors: int
    num_timeouts: int
    overlong_penalty: np.ndarray | None = None  # float32 [N] when the overlong buffer is enabled

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        out = {f"{prefix}/num_errors": float(self.num_errors), f"{prefix}/num_timeouts": float(self.num_timeouts)}
        for key, values in self.extras.items():
            finite = values[np.isfinite(values)]
            if finite.size:
                out[f"{prefix}_extra/{key}/mean"] = float(finite.mean())
        if self.overlong_penalty is not None:
            out[f"{prefix}/overlong_penalty/mean"] = float(self.overlong_penalty.mean())
        return out


class RewardManager:
    """Scores responses in parallel with a per-call timeout; keeps running error/timeout totals."""

    def __init__(
        self,
        spec: ScoreSpec | None = None,
        *,
        reward_manager: str = "naive",
        num_workers: int = 4,
        timeout_s: float | None = 10.0,
        fail_on_error: bool = False,
        overlong_buffer_len: int = 0,
        overlong_penalty_factor: float = 1.0,
        max_response_length: int | None = None,
        experiment_name: str = "",
    ):
        if reward_manager not in REWARD_MANAGERS:
            raise ValueError(f"reward_model.reward_manager must be one of {REWARD_MANAGERS}, got {reward_manager!r}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"reward_model.timeout_s must be positive or null, got {timeout_s}")
        if overlong_buffer_len and max_response_length is None:
            raise ValueError("reward_model.overlong_buffer needs data.max_response_length")
        self.spec = spec or ScoreSpec()
        self.kind = reward_manager
        self.experiment_name = experiment_name  # verl's gdpo manager hands it to the function in extra_info
        self.num_workers = int(num_workers)
        self.timeout_s = timeout_s
        self.fail_on_error = fail_on_error
        self.overlong = (int(overlong_buffer_len), float(overlong_penalty_factor), max_response_length)
        self.total_errors = 0
        self.total_timeouts = 0
        if self.spec.path:  # a broken file stops here, before any model is built
            check_reward_file(self.spec.path, self.spec.name)
        if reward_manager != "prime":
            guard_os_exit()  # before the user's module is imported (it may bind os._exit itself)
        self._fn = self.spec.load() if reward_manager != "prime" else None
        self._pool = ProcessPool(self.spec, self.num_workers) if reward_manager == "prime" else None

    def score(
        self,
        data_sources: Sequence[str],
        solutions: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict[str, Any] | None] | None = None,
        response_lengths: Sequence[int] | np.ndarray | None = None,
    ) -> RewardResult:
        """Score each (data_source, decoded response, ground truth, extra_info) and return scores + counters."""
        n = len(solutions)
        if not (len(data_sources) == len(ground_truths) == n):
            raise ValueError(f"lengths differ: {len(data_sources)} data_sources, {n} solutions, "
                             f"{len(ground_truths)} ground truths")
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        if self.kind == "gdpo":
            extra_infos = [{**(e or {}), "experiment_name": self.experiment_name} for e in extra_infos]
        calls = [(data_sources[i], solutions[i], ground_truths[i], extra_infos[i] or {}) for i in range(n)]
        if self._pool is not None:
            outcomes = self._pool.map(calls, self.timeout_s)
        elif self.kind == "batch":
            outcomes = self._score_batch(calls)
        else:
            assert self._fn is not None
            outcomes = run_in_threads(self._fn, calls, self.timeout_s, self.num_workers)
        return self._collect(outcomes, data_sources, response_lengths)

    def _score_batch(self, calls: list[tuple]) -> list[Outcome]:
        """One call for the whole batch (in a thread with the timeout); its failure is every row's."""
        def whole(*_: Any) -> float:
            columns = list(zip(*calls)) if calls else [[], [], [], []]
            results = self._fn(data_sources=list(columns[0]), solution_strs=list(columns[1]),
                               ground_truths=list(columns[2]), extra_infos=list(columns[3]))
            if len(results) != len(calls):
                raise ValueError(f"batch reward function returned {len(results)} results for {len(calls)} responses")
            box.extend(results)
            return 0.0

        box: list = []
        (outcome,) = run_in_threads(whole, [()], self.timeout_s, 1)
        if outcome.status != "ok":
            return [outcome] * len(calls)
        outcomes = []
        for result in box:
            try:
                score, extras = normalize_result(result)
                outcomes.append(Outcome("ok", score, extras))
            except (ValueError, TypeError) as e:
                outcomes.append(Outcome("error", message=str(e)))
        return outcomes

    def _collect(self, outcomes: list[Outcome], data_sources: Sequence[str], response_lengths: Any) -> RewardResult:
        n = len(outcomes)
        scores = np.zeros(n, dtype=np.float32)
        keys = sorted({k for o in outcomes for k in o.extras})
        extras = {k: np.full(n, np.nan, dtype=np.float32) for k in keys}
        errors = timeouts = 0
        for i, o in enumerate(outcomes):
            if o.status == "ok":
                scores[i] = o.score
                for k, v in o.extras.items():
                    extras[k][i] = v
                continue
            if self.fail_on_error:
                raise RewardFunctionError(
                    f"reward function {o.status} on response {i} (data_source={data_sources[i]!r}):\n{o.message}")
            if o.status == "timeout":
                timeouts += 1
            else:
                errors += 1
            if errors + timeouts <= 3:
                log.warning("reward %s on response %d (data_source=%r); scored 0: %s",
                            o.status, i, data_sources[i], o.message.strip().splitlines()[-1:] or "")
        self.total_errors += errors
        self.total_timeouts += timeouts
        penalty = None
        buffer_len, factor, max_len = self.overlong
        if buffer_len:
            if response_lengths is None:
                raise ValueError("reward_model.overlong_buffer.enable needs response_lengths")
            from rlhf_jax.rewards.shaping import overlong_penalty

            penalty = np.asarray(overlong_penalty(np.asarray(response_lengths), max_len, buffer_len, factor))
            scores = scores + penalty
        return RewardResult(scores, extras, errors, timeouts, penalty)

    def metrics(self) -> dict[str, float]:
        """Running totals since construction (log these every step)."""
        return {"reward/num_errors_total": float(self.total_errors),
                "reward/num_timeouts_total": float(self.total_timeouts)}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @classmethod
    def from_config(
        cls, reward_cfg: Any, custom_cfg: Any, max_response_length: int | None = None, experiment_name: str = ""
    ) -> RewardManager:
        """From a finalized config's `reward_model` (reward_manager, num_workers, timeout_s, fail_on_error,
        scorer_kwargs, overlong_buffer.{enable,len,penalty_factor}) and `custom_reward_function` (path, name);
        ``experiment_name`` (trainer.experiment_name) for the gdpo manager."""
        r, overlong = reward_cfg, reward_cfg.overlong_buffer
        return cls(
            spec_from_config(custom_cfg, reward_cfg),
            reward_manager=r.reward_manager,
            num_workers=int(r.num_workers),
            timeout_s=float(r.timeout_s),
            fail_on_error=bool(r.fail_on_error),
            overlong_buffer_len=int(overlong.len) if overlong.enable else 0,
            overlong_penalty_factor=float(overlong.penalty_factor),
            max_response_length=max_response_length,
            experiment_name=experiment_name,
        )
