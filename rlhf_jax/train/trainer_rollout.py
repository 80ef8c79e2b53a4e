"""Sampling and scoring with the policy's current weights.

``Rollouts`` samples prompt batches (single-turn, or the multi-turn rollout) with the sampler's weights (merged
LoRA adapters, a copy on separate rollout devices) and scores the responses; the RL trainer and the validation
of RL and SFT runs use it. ``Producer`` turns one prompt batch into a ``ScoredBatch`` for an RL update, with
DAPO's dynamic sampling and ReMax's greedy baselines.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from rlhf_jax.models import lora
from rlhf_jax.parallel import batch_sharding
from rlhf_jax.rewards.reward_model import decode_responses
from rlhf_jax.rewards.manager import RewardFunctionError
from rlhf_jax.rollout.sampler import cast_floating
from rlhf_jax.train import metrics as M
from rlhf_jax.train.offload import to_device
from rlhf_jax.parallel import groups
from rlhf_jax.parallel.hosts import all_rows, gather_all, to_global, to_local
from rlhf_jax.rollout.dynamic_sampling import OPTIONAL_KEYS, ROLLOUT_KEYS, Collected, varied_groups
from rlhf_jax.rollout.generation import generate_batch, key_function
from rlhf_jax.rollout.segments import Refresh, SegmentedSampler
from rlhf_jax.runtime.loggers import dump_generations
from rlhf_jax.runtime.preemption import StepAbandoned, StopRequest
from rlhf_jax.types import PromptBatch, RolloutBatch, ScoredBatch


def merge_dtype(weight_dtype: str | None, compute_dtype: str | None) -> str | None:
    """The dtype the LoRA merge makes the sampler's weights in: its copy's (``rollout.weight_dtype``) when set, else
    the dtype it computes in (the model casts each weight at use, so a narrower merge changes no product)."""
    return weight_dtype or compute_dtype


def scorers(cfg, mesh, rules) -> tuple[Any, Any]:
    """(reward manager, reward model scorer or None) of a run. The reward model lives on ``mesh``, where the
    responses are sampled (the rollout devices or the sampling processes'), so it scores while the update runs."""
    from rlhf_jax.rewards import RewardManager

    rewards = RewardManager.from_config(cfg.reward_model, cfg.custom_reward_function,
                                        max_response_length=cfg.actor_rollout_ref.rollout.response_length,
                                        experiment_name=cfg.trainer.experiment_name)
    if not cfg.reward_model.enable:
        return rewards, None
    from rlhf_jax.rewards import RewardModelScorer

    return rewards, RewardModelScorer.from_config(cfg.reward_model, mesh=mesh, rules=rules)


class Rollouts:
    """The sampler over the actor's weights, and the scorers of its responses."""

    def __init__(self, actor, sampler, tokenizer, reward_manager, *, mesh, rules, dp_size: int, reward_model=None,
                 multi_turn=None, rollout_mesh=None,
                 weight_dtype: str | None = None, compute_dtype: str | None = None, lora: Any = None):
        """``sampler`` runs ``actor``'s weights on ``rollout_mesh`` (None: the training mesh); ``multi_turn``: the
        tool-calling rollout (train/multi_turn.py) or None; ``reward_model``: a scorer that replaces the rule-based
        ``reward_manager``, or None; ``weight_dtype``: the dtype of the sampler's copy of the weights
        (``rollout.weight_dtype``; None: no copy); ``compute_dtype``: the sampler's (under LoRA the merged weights
        are made in it where it is narrower: the products are the same, the copy is smaller); ``lora``: the
        actor's ``LoraSpec`` where there is no ``actor`` here (the sampling processes of a split run)."""
        self.actor, self.sampler, self.tok, self.reward_manager = actor, sampler, tokenizer, reward_manager
        self.mesh, self.rules, self.dp_size = mesh, rules, dp_size
        self.reward_model, self.multi_turn, self.rollout_mesh = reward_model, multi_turn, rollout_mesh
        self._key_fn = key_function(mesh)
        self.weight_dtype = weight_dtype
        self.merge_dtype = merge_dtype(weight_dtype, compute_dtype)
        self.lora = actor.config.lora if actor is not None else lora
        self._merge_fn = None
        self._rollout_params_of: tuple[Any, Any] | None = None  # (actor params, their copy on the rollout mesh)

    def key(self, seed: int, step: int) -> jax.Array:
        """The sampler key of (seed, step) (see train/generation.py)."""
        return self._key_fn(seed, step)

    def _sampler_params(self, state=None):
        """The sampler's weights from the actor's state (default: the actor's own now), with the adapters merged in
        under LoRA (a temporary copy of the adapted weights only, for the rollout; the decode step then runs no
        extra low-rank matmuls). Parameters the actor keeps in host memory are copied to the devices here, and the
        copy is freed with the rollout."""
        spec = self.lora
        state = self.actor.device_state() if state is None else state
        if not spec:
            return state
        if self._merge_fn is None:
            if self.actor is not None:
                shardings = {lora.path_key(p): v.get_value()
                             for p, v in nnx.to_flat_state(to_device(self.actor.frozen_shardings))}
            else:  # the merged weights keep the base weights' layout
                shardings = {lora.path_key(p): v.get_value().sharding for p, v in nnx.to_flat_state(state)}
            merge = functools.partial(lora.merged_weights, spec=spec, dtype=self.merge_dtype)
            shapes = jax.eval_shape(merge, state)
            self._merge_fn = jax.jit(merge, out_shardings={k: shardings[k] for k in shapes})
        return lora.merged_state(state, spec, self._merge_fn(state))

    def _in_weight_dtype(self, weights):
        """``weights`` in ``weight_dtype`` (a copy, freed when the rollout that reads it ends), or as they are."""
        return weights if self.weight_dtype is None else cast_floating(weights, self.weight_dtype)

    def sampler_weights(self, state=None):
        """What the sampler runs on, made from the actor's state (default: the actor's own now): adapters merged
        under LoRA, in ``weight_dtype`` when set."""
        return self._in_weight_dtype(self._sampler_params(state))

    def adapters(self):
        """The actor's LoRA adapters alone (what changes with each update under LoRA), as an ``nnx.State``."""
        return nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(self.actor.device_state())
                                    if lora.is_adapter(p)])

    def weights(self):
        """The sampler's weights (in ``weight_dtype`` when set) where it runs: on separate rollout devices, a copy
        made once per update."""
        if self.rollout_mesh is None:
            return self.sampler_weights()
        params = self.actor.params  # replaced by every update
        if self._rollout_params_of is None or self._rollout_params_of[0] is not params:
            weights = self.sampler_weights()  # cast first: fewer bytes to move
            shardings = jax.tree.map(lambda x: NamedSharding(self.rollout_mesh, x.sharding.spec), weights)
            self._rollout_params_of = (params, jax.device_put(weights, shardings))
        return self._rollout_params_of[1]

    def generate(self, pb: PromptBatch, sampling, key, bucket: bool = True, weights: Any = None,
                 segments: SegmentedSampler | None = None):
        """Sample from a (process-local) prompt batch (see train/generation.py) with ``weights`` (default: the
        current ones), in segments that may take newer weights when ``segments`` is given (partial rollouts); the
        result is on the training mesh."""
        mesh = self.rollout_mesh or self.mesh
        dp = self.dp_size if self.rollout_mesh is None else self.rollout_mesh.devices.size
        weights = self.weights() if weights is None else weights
        sampler = self.sampler if segments is None else segments
        out, keep = generate_batch(sampler, weights, mesh, dp, pb, sampling, key, bucket)
        if self.rollout_mesh is not None:  # rows of any rank: tokens (N, T), R3's expert ids (N, T, layers, k)
            out = jax.tree.map(lambda x: jax.device_put(x, batch_sharding(self.mesh, x.ndim, self.rules)), out)
        return out, keep

    def sample(self, pb: PromptBatch, sampling, key, out_metrics: dict, bucket: bool = True, weights: Any = None,
               segments: SegmentedSampler | None = None, training: bool = False):
        """Single-turn sampling (``generate``) or the multi-turn rollout; (batch, kept rows, the mask of the
        response tokens the reward reads: every token of the sequence, tool responses included)."""
        if self.multi_turn is None:
            out, keep = self.generate(pb, sampling, key, bucket, weights, segments)
            return out, keep, out.response_mask
        weights = self.weights() if weights is None else weights
        out, metrics = self.multi_turn.rollout(weights, pb, sampling, key, training)
        out_metrics.update(metrics)
        return out, len(pb) * sampling.n, out.valid_mask()

    def score(self, pb: PromptBatch, responses: np.ndarray, rmask: np.ndarray,
              n: int) -> tuple[np.ndarray, dict, list[str], dict[str, np.ndarray]]:
        """(scores (rows,), reward metrics, response texts, the reward function's extra values) of ``n`` responses
        per prompt of ``pb``."""
        texts = decode_responses(self.tok, responses, rmask)
        rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731  prompt-major, as the sampler orders rows
        env_scores = self.multi_turn.take_scores() if self.multi_turn is not None else None
        if env_scores is not None:  # an environment's rewards (multi_turn.environment) are the scores
            return env_scores, {}, texts, {}
        if self.reward_model is not None:  # as in verl: the reward model's score replaces rule-based scoring
            return self.reward_model.score_texts(rep(pb.raw_prompt), texts), {}, texts, {}
        infos = rep(pb.extra_info)
        added = self.multi_turn.take_extra_info() if self.multi_turn is not None else None
        if added is not None:  # per trajectory (an interaction's turn scores)
            infos = [{**(e or {}), **a} for e, a in zip(infos, added)]
        result = self.reward_manager.score(rep(pb.data_source), texts, rep(pb.ground_truth), infos,
                                           response_lengths=rmask.sum(-1))
        return result.scores.astype(np.float32), result.metrics(), texts, result.extras

    def close(self) -> None:
        self.reward_manager.close()
        if self.multi_turn is not None:
            self.multi_turn.close()


def reward_components(extras: dict[str, np.ndarray], keys: tuple[str, ...]) -> np.ndarray:
    """(rows, K) float32: the reward function's values ``keys`` of every response (GDPO's components). A missing
    one is a RewardFunctionError, which ``main`` reports in one line."""
    columns = []
    for key in keys:
        if key not in extras:
            raise RewardFunctionError(f"algorithm.gdpo_reward_keys: the reward function returned no {key!r} (it returned "
                             f"{sorted(extras) or 'a number, not a dict'}); return {{'score': ..., {key!r}: ...}}")
        values = np.asarray(extras[key], np.float32)
        if np.isnan(values).any():
            raise RewardFunctionError(f"algorithm.gdpo_reward_keys: the reward function returned no {key!r} for "
                             f"{int(np.isnan(values).sum())} of {len(values)} responses; every response needs it")
        columns.append(values)
    return np.stack(columns, axis=1)


@dataclasses.dataclass
class Producer:
    """Prompt batch -> ScoredBatch for training step ``step``: sample, score (per-turn rewards of multi-turn
    rollouts), DAPO's dynamic sampling (``algorithm.filter_groups``) and ReMax's greedy baselines."""

    rollouts: Rollouts
    sampling: Any  # the training SamplingParams
    filter_groups: Any  # the algorithm.filter_groups section
    greedy_baseline: bool  # the estimator needs a greedy rollout's score per prompt (ReMax)
    rollout_data_dir: str | None  # trainer.rollout_data_dir: where sampled responses are dumped
    loader: Any  # dynamic sampling draws further prompt batches from it
    stop: StopRequest
    component_keys: tuple[str, ...] = ()  # GDPO: the reward function's values kept per response (N, K)
    partial_tokens: int = 0  # experience.partial_rollout_tokens: responses drawn in segments this long (0: whole)

    def produce(self, pb: PromptBatch, step: int, data_state: Any = None, abandonable: bool = True,
                weights: Any = None, version: int = 0, refresh: Refresh | None = None) -> ScoredBatch:
        """Sample and score one prompt batch for training step ``step`` (0-based) with ``weights`` of version
        ``version`` (default: the current ones); with ``partial_tokens``, between segments ``refresh`` may hand
        over newer weights (each token then records its version)."""
        timer = M.Timer()
        out_metrics: dict[str, Any] = {}
        extras: dict[str, np.ndarray] = {}
        segments = None
        if self.partial_tokens:
            segments = SegmentedSampler(self.rollouts.sampler, self.partial_tokens, version, refresh)
        draws = 1
        if self.filter_groups.enable:
            out, pb, scores, draws, components, baselines = self._dynamic_rollout(
                pb, timer, out_metrics, step, version, weights, abandonable, segments)
        else:
            out, scores = self._rollout(pb, timer, out_metrics, self.rollouts.key(self.sampling.seed, step), step,
                                        extras, abandonable=abandonable, weights=weights, version=version,
                                        segments=segments)
            components = reward_components(extras, self.component_keys) if self.component_keys else None
            baselines = None
            if self.greedy_baseline:
                with timer("gen_max"):  # verl's name for ReMax's greedy baseline rollout
                    baselines = self._greedy_baselines(pb, step, weights)
        mesh = self.rollouts.mesh
        with timer("reward"):
            scores = jax.block_until_ready(to_global(mesh, np.asarray(scores, np.float32)))
            # GDPO's components and ReMax's baselines, of this process's rows
            components, baselines = (None if x is None else to_global(mesh, x) for x in (components, baselines))
        out_metrics.update({f"timing_s/{k}": v for k, v in timer.seconds.items()})
        return ScoredBatch(rollout=out, scores=scores, baselines=baselines, prompts=pb, version=version,
                           data_state=data_state, metrics=out_metrics, components=components, draws=draws)

    def _rollout(self, pb: PromptBatch, timer, out_metrics: dict, key, step: int, extras: dict | None = None,
                 abandonable: bool = True, weights: Any = None, version: int = 0,
                 segments: SegmentedSampler | None = None):
        """Sample the prompts and score the responses for training step ``step`` (0-based): (the sampler's batch,
        process-local scores (N,), or token-level rewards (N, R) with multi_turn.per_turn_rewards).
        ``abandonable``: a stop request abandons the step after the sampling."""
        r, n = self.rollouts, self.sampling.n
        with timer("gen"):  # waits for the sampler: dispatch is asynchronous, the reward would be billed for it
            # every row is trained on
            out, _, text_mask = r.sample(pb, self.sampling, key, out_metrics, bucket=False, weights=weights,
                                         segments=segments, training=True)
            out = jax.block_until_ready(out)
        if segments is not None:
            out_metrics["rollout/segment_versions"] = float(len(set(segments.used)))
        if abandonable and self.stop.agreed():
            raise StepAbandoned
        with timer("reward"):
            scores, reward_metrics, texts, found = r.score(pb, to_local(out.responses), to_local(text_mask), n)
        out_metrics.update(reward_metrics)
        if self.rollout_data_dir:
            dump_generations(os.path.expanduser(self.rollout_data_dir), step + 1,
                             [t for t in pb.prompt_text for _ in range(n)], texts,
                             [g for g in pb.ground_truth for _ in range(n)], scores, weight_version=version)
        if extras is not None:
            extras.update(found)
        token_rewards = r.multi_turn.take_token_rewards() if r.multi_turn is not None else None
        if token_rewards is not None:  # multi_turn.per_turn_rewards: each turn's reward on its last token
            return out, token_rewards
        return out, scores

    def _dynamic_rollout(self, pb: PromptBatch, timer, out_metrics: dict, step: int, version: int,
                         weights: Any = None, abandonable: bool = True, segments: SegmentedSampler | None = None):
        """DAPO's dynamic sampling (rollout/dynamic_sampling.py): batches until train_batch_size groups vary, all
        sampled with ``weights`` (version ``version``). Returns (rollout, prompts, scores, prompt batches drawn,
        GDPO's reward components and ReMax's greedy baselines of the kept rows, each or None).

        Over several processes every process sees every row: the groups kept are chosen from the whole batch (the
        same choice everywhere, so all draw the same number of batches), and each takes its block of the kept
        rows back, as ``to_global`` lays a batch out."""
        fg, n = self.filter_groups, self.sampling.n
        processes = groups.process_count()
        wanted = len(pb) * processes  # prompt groups in the global batch
        collected = Collected(n, int(self.sampling.pad_token_id))
        base_key, rounds = self.rollouts.key(self.sampling.seed, step), 0
        while True:
            extras: dict = {}
            key = base_key if rounds == 0 else jax.random.fold_in(base_key, rounds)
            out, scores = self._rollout(pb, timer, out_metrics, key, step, extras, abandonable=abandonable,
                                        weights=weights, version=version, segments=segments)
            rounds += 1
            if fg.metric == "acc" and "acc" not in extras:
                raise ValueError("algorithm.filter_groups.metric=acc: the reward function returns no 'acc' (return "
                                 "{'score': ..., 'acc': ...}) ; or set the metric to score")
            values = extras["acc"] if fg.metric == "acc" else scores
            domain = None if pb.domain is None else all_rows(np.repeat(pb.domain, n))
            components = all_rows(reward_components(extras, self.component_keys)) if self.component_keys else None
            baselines = None
            if self.greedy_baseline:  # each drawn batch's own prompts' greedy responses
                with timer("gen_max"):
                    baselines = all_rows(self._greedy_baselines(pb, step, weights))
            kept = (*ROLLOUT_KEYS, *(k for k in OPTIONAL_KEYS if getattr(out, k) is not None))
            collected.add({k: gather_all(getattr(out, k)) for k in kept}, all_rows(scores),
                          varied_groups(all_rows(values), n), domain=domain, components=components,
                          baselines=baselines)
            if collected.num_groups >= wanted:
                break
            if 0 < fg.max_num_gen_batches <= rounds:
                raise ValueError(f"algorithm.filter_groups: {rounds} generation batches gave {collected.num_groups} of "
                                 f"{wanted} prompt groups with varied {fg.metric}: the data may be too easy or too "
                                 "hard; raise max_num_gen_batches (0 = no limit)")
            pb = next(self.loader)
        out_metrics["train/num_gen_batches"] = float(rounds)
        rows = collected.batch(wanted)
        own = slice(groups.process_index() * len(pb) * n, (groups.process_index() + 1) * len(pb) * n)
        rows = {k: v[own] for k, v in rows.items()}
        if "domain" in rows:  # the kept groups' domains, not the last batch's
            pb = pb.replace(domain=rows["domain"][::n])
        out = RolloutBatch(**{k: to_global(self.rollouts.mesh, rows[k]) for k in (*ROLLOUT_KEYS, *OPTIONAL_KEYS)
                              if k in rows})
        return out, pb, rows["scores"], rounds, rows.get("components"), rows.get("baselines")

    def _greedy_baselines(self, pb: PromptBatch, step: int, weights: Any = None) -> np.ndarray:
        """ReMax's baseline: the score of one greedy response per prompt, repeated for the prompt's n samples (this
        process's rows). With
        multi-turn rollouts the greedy response is a whole conversation (or episode) played as the samples are, and
        its score is the samples' kind: the environment's summed rewards, the workflow's reward, or the reward
        function's on every response token."""
        greedy = dataclasses.replace(self.sampling, n=1, do_sample=False)
        r = self.rollouts
        key = r.key(greedy.seed, step)
        if r.multi_turn is None:
            out, keep = r.generate(pb, greedy, key, weights=weights)
            responses, mask = to_local(out.responses)[:keep], to_local(out.response_mask)[:keep]
        else:  # this process's conversations, not laid out as a batch: one per prompt need not fill the mesh
            arrays, _ = r.multi_turn.play(r.weights() if weights is None else weights, pb, greedy, key)
            r.multi_turn.take_token_rewards()  # per-turn rewards: the baseline is the episode's whole score
            responses, mask = arrays["responses"], arrays["response_valid"]
        scores, _, _, _ = r.score(pb, responses, mask, 1)
        return np.repeat(scores, self.sampling.n).astype(np.float32)
