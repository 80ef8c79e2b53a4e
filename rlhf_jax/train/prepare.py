"""ScoredBatch -> TrainBatch: the passes between sampling and the updates of one RL step.

The sequences on the response grid the updates use, then the old log-probs (and the rollout correction that
compares them with the sampler's), the reference log-probs and the values, each as its pass is planned (padded or
packed), and the advantages. ``StepPasses`` (train/passes.py) says which passes run: the memory plan reads the
same decision, so it compiles exactly what runs here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.parallel import groups
from rlhf_jax import algos
from rlhf_jax.batch import trim_columns
from rlhf_jax.rewards import place_on_last_token
from rlhf_jax.parallel.hosts import gather_all, to_global
from rlhf_jax.train.layout import Packer, layout
from rlhf_jax.train.metrics import Timer
from rlhf_jax.train.passes import PassPlan, StepPasses
from rlhf_jax.runtime.preemption import StepAbandoned, StopRequest
from rlhf_jax.types import RolloutBatch, ScoredBatch, TrainBatch


@dataclasses.dataclass
class Prepared:
    """A TrainBatch and what the step's metrics and updates read besides it."""

    batch: TrainBatch
    layouts: dict[str, Any]  # the pass name -> its layout (Padded | Packed) for this batch
    host: dict[str, np.ndarray]  # global host copies of the sequences (prompts, masks, responses)
    token_scores: jax.Array  # (N, R') the scores on the response grid
    rewards: jax.Array  # (N, R') token rewards (with the in-reward KL)
    sampled_mask: jax.Array  # (N, R') the response mask before any rejection
    current_kl: jax.Array  # the batch's KL for the in-reward KL controller
    metrics: dict[str, float]
    packer: Packer  # counts the tokens the packed passes lay out (its metrics grow until the step ends)


@dataclasses.dataclass(frozen=True)
class ScoreShaping:
    """What happens to the scores before they become token rewards (algorithm.reward_norm.*,
    algorithm.sample_mask.*): ROLL's reward normalisation and its masks of whole responses."""

    norm_mean: str | None = None
    norm_std: str | None = None
    truncated: bool = False  # responses of max_length tokens leave the loss
    difficulty: tuple[float, float] | None = None  # groups whose mean score is outside (low, high) leave it
    max_length: int = 0

    @property
    def masks(self) -> bool:
        return self.truncated or self.difficulty is not None

    def keep(self, lengths, scores, group_ids):
        """(keep (N,), metrics) of the responses that stay in the loss."""
        return algos.sample_mask(lengths, scores, group_ids, max_length=self.max_length, truncated=self.truncated,
                                 difficulty=self.difficulty)

    def normalize(self, scores, group_ids, segment_ids):
        return algos.normalize_scores(scores, group_ids, segment_ids, self.norm_mean, self.norm_std)


@dataclasses.dataclass
class Preparer:
    """Turns one ScoredBatch into a TrainBatch with the roles' current weights (nothing of the trainer changes)."""

    passes: StepPasses
    plans: dict[str, PassPlan]  # the memory plan's layout of every pass
    actor: Any
    ref: Any  # the reference Role, or None
    value_role: Any  # the Role whose values the step reads (the critic, or the actor's value head), or None
    correction: Any  # the RolloutCorrection settings
    correction_fn: Callable  # (old, rollout log-probs, mask) -> (weights or None, mask, metrics)
    mismatch_fn: Callable  # (old, rollout log-probs, mask) -> the rollout/training mismatch metrics
    advantage_fn: Callable  # steps.advantage_stage with the estimator's settings bound
    temperature: float  # the log-prob temperature (the sampler's)
    n: int  # samples per prompt
    mesh: Any
    dp: int
    pad_token_id: int
    stop: StopRequest
    shaping: ScoreShaping = ScoreShaping()
    # actor_rollout_ref.actor.router_replay.mode: R3 replays the sampler's expert ids in every actor pass (the
    # rollout carries them); R2 records them in the old-log-prob pass for the update (the ref pass routes natively)
    router_replay: str = "disabled"

    def __call__(self, scored: ScoredBatch, kl_coef: jax.Array, timer: Timer) -> Prepared:
        """Raises StepAbandoned on a stop request after the forward passes (before anything changes)."""
        out, metrics = scored.rollout, {}
        host = {k: gather_all(getattr(out, k)) for k in ("prompts", "prompt_mask", "responses", "response_mask")}
        rows = len(scored.prompts)
        group_ids = to_global(self.mesh, np.repeat(np.arange(rows) + groups.process_index() * rows,
                                                   self.n).astype(np.int32))
        # batch statistics per data domain (ROLL groups its batch by domain), else over the whole batch
        domain = scored.prompts.domain
        segment_ids = jnp.zeros_like(group_ids) if domain is None else to_global(
            self.mesh, np.repeat(np.asarray(domain, np.int32), self.n))
        keep = None
        with timer("reward"):  # the reward stage's last part: each score placed on its response's last token
            token_scores = scored.scores  # (N, R) already with multi_turn.per_turn_rewards
            if self.shaping.masks:  # judged on the raw scores, before any normalisation
                row_scores = token_scores if token_scores.ndim == 1 else jnp.sum(token_scores, -1)
                keep, mask_metrics = self._keep(jnp.sum(out.valid_mask(), -1), row_scores, group_ids)
                metrics.update({k: float(v) for k, v in mask_metrics.items()})
            if self.shaping.norm_mean is not None or self.shaping.norm_std is not None:
                token_scores = self._normalize(token_scores, group_ids, segment_ids)  # (N,): a rule sees to it
            if token_scores.ndim == 1:
                token_scores = jax.block_until_ready(place_on_last_token(token_scores, out.response_mask))
        host["response_valid"] = gather_all(out.valid_mask())  # the sequence's tokens (tool responses too)
        batch, rollout_logprobs = self._sequences(out, host, metrics)
        packer = Packer(self.mesh, self.dp, self.pad_token_id,
                        lambda: {k: host[k] for k in ("prompts", "prompt_mask", "responses", "response_valid")})
        layouts = {name: layout(plan, packer) for name, plan in self.plans.items()}
        squares, recorded = None, None
        if self.passes.old_log_prob:
            with timer("old_log_prob"):
                record = self.router_replay == "R2"
                old = layouts["old_log_prob"].log_probs(self.actor, batch, self.temperature,
                                                        sum_pi_squared=self.passes.sum_pi_squared,
                                                        **({"record_routes": True} if record else {}))
                if record:
                    old, recorded = old
                if self.passes.sum_pi_squared:
                    old, squares = old
                metrics.update({k: float(v) for k, v in self.mismatch_fn(old, rollout_logprobs,
                                                                          batch.response_mask).items()})
        else:
            old = rollout_logprobs  # unused by the loss (ratio 1), kept for shapes
        batch, sampled_mask = batch.replace(old_log_probs=old, sum_pi_squared=squares), batch.response_mask
        if self.correction.enabled:  # before the advantages: rejected tokens leave every later stage
            weights, mask, corr_metrics = self.correction_fn(old, rollout_logprobs, sampled_mask)
            batch = batch.replace(response_mask=mask, rollout_is_weights=weights)
            metrics.update({k: float(v) for k, v in corr_metrics.items()})
        if keep is not None:  # whole responses leave the loss, the advantages' statistics and every later stage
            batch = batch.replace(response_mask=batch.response_mask * keep[:, None].astype(batch.response_mask.dtype))
        if self.passes.ref and self.passes.teacher_topk:  # the distillation teacher's top-k (forward_kl_topk)
            with timer("ref"):
                top_logp, top_ids = jax.block_until_ready(
                    layouts["ref"].log_probs(self.ref, batch, self.temperature, topk=self.passes.teacher_topk))
                batch = batch.replace(teacher_topk_ids=top_ids, teacher_topk_log_probs=top_logp)
        elif self.passes.ref:
            with timer("ref"):
                batch = batch.replace(ref_log_probs=jax.block_until_ready(
                    layouts["ref"].log_probs(self.ref, batch, self.temperature)))
        if recorded is not None:  # R2: the update replays the old-log-prob pass's routes
            batch = batch.replace(routed_experts=recorded)
        if self.passes.values:
            with timer("values"):
                batch = batch.replace(values=jax.block_until_ready(layouts["values"].values(self.value_role, batch)))
        if self.stop.agreed():  # the last point before the step changes state (KL controller, weights)
            raise StepAbandoned
        with timer("adv"):
            token_scores = token_scores[:, :batch.response_mask.shape[1]]
            rewards, adv, returns, current_kl = self.advantage_fn(
                token_scores, batch.response_mask, group_ids, batch.old_log_probs, batch.ref_log_probs, batch.values,
                kl_coef, scored.baselines, scored.components, batch.sum_pi_squared, batch.rollout_is_weights,
                segment_ids)
            adv, returns = jax.block_until_ready((adv, returns))
            batch = batch.replace(advantages=adv, returns=returns)
        return Prepared(batch, layouts, host, token_scores, rewards, sampled_mask, current_kl, metrics, packer)

    def __post_init__(self):
        self._keep = jax.jit(self.shaping.keep)
        self._normalize = jax.jit(self.shaping.normalize)

    def _sequences(self, out: RolloutBatch, host: dict, metrics: dict) -> tuple[TrainBatch, jax.Array]:
        """The sequences and the sampler's log-probs on the same (N, R') response grid.

        Packed passes keep the full response width R (their shapes do not depend on it); when no pass is packed,
        the all-padding prompt and response columns are cut (to power-of-two widths).
        """
        if any(p.packed for p in self.plans.values()):
            width_p, width_r = out.prompts.shape[1], out.responses.shape[1]
        else:
            width_p, width_r = trim_columns(host["prompt_mask"], host["response_valid"])
        P = out.prompts.shape[1]
        responses, rmask = out.responses[:, :width_r], out.response_mask[:, :width_r]
        # The attention mask covers every token of the sequence; response_mask only the trained ones (multi-turn
        # rollouts leave holes at tool responses), which every loss, entropy, KL and token mean uses.
        routes = out.routed_experts if self.router_replay == "R3" else None
        batch = TrainBatch(
            input_ids=jnp.concatenate([out.prompts[:, P - width_p:], responses], axis=1),
            attention_mask=jnp.concatenate([out.prompt_mask[:, P - width_p:], out.valid_mask()[:, :width_r]], axis=1),
            responses=responses, response_mask=rmask,
            routed_experts=None if routes is None else routes[:, P - width_p:P + width_r])
        real = int(host["prompt_mask"].sum() + host["response_valid"].sum())
        metrics.update({"perf/real_tokens": float(real),
                        "perf/padded_tokens_unpacked": float(host["responses"].shape[0] * (width_p + width_r))})
        return batch, out.logprobs[:, :width_r]
