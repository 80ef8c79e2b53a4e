"""Pure, jittable step functions: log-probs, values, and the actor and critic mini-batch updates.

A training batch is a ``rlhf_jax.types.TrainBatch`` of global (N, ...) arrays sharded over the batch axes: the
sequences (N, P + R), the responses and their mask (N, R), and the per-token arrays the run computes.

Micro-batches are taken with a stride (row ``j * n_micro + i`` belongs to micro-batch
``i``) so that every micro-batch keeps rows on every data-parallel shard: splitting
needs no communication. Loss denominators are computed once over the whole
mini-batch and passed to every micro-batch, so gradient accumulation gives exactly
the gradient of the mini-batch (the micro-batch normalisation bug of the PyTorch
frameworks does not exist here).

A Mixture-of-Experts actor adds the router's load-balancing loss (``models.moe.load_balancing_loss``,
transformers' definition over the real tokens of a forward pass) times ``router_aux_loss_coef``. That loss is
not a sum over tokens, so it is formed per micro-batch and weighted by the micro-batch's share of the
mini-batch's response tokens: with one micro-batch it is exactly transformers' value for the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rlhf_jax import algos
from rlhf_jax.algos.distillation import DistillSpec
from rlhf_jax.models.moe import load_balancing_loss
from rlhf_jax.train.token_outputs import token_log_probs, token_top_k
from rlhf_jax.types import TrainBatch


def split_micro(tree: Any, n_micro: int) -> Any:
    """(N, ...) -> (n_micro, N // n_micro, ...), micro-batch i = rows i, i + n_micro, ..."""
    def split(x):
        return jnp.swapaxes(x.reshape((x.shape[0] // n_micro, n_micro) + x.shape[1:]), 0, 1)

    return jax.tree.map(split, tree)


def merge_micro(tree: Any) -> Any:
    """Inverse of ``split_micro``."""
    def merge(x):
        return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])

    return jax.tree.map(merge, tree)


def response_log_probs(model, input_ids, attention_mask, responses, temperature: float, with_entropy: bool,
                       with_router_stats: bool = False, with_sum_pi_squared: bool = False, routes=None,
                       record_routes: bool = False):
    """Log-probs (and entropies) of ``responses`` under ``model`` at ``temperature``; (b, R) float32.
    ``with_router_stats``: (that, the MoE router statistics over the real tokens). ``routes``: expert ids a MoE
    model replays; ``record_routes``: (that, the expert ids it used (b, T, sparse layers, K))."""
    R = responses.shape[1]
    if routes is not None or record_routes:
        out = model.hidden_states(input_ids, attention_mask, routes=routes, record_routes=record_routes)
        hidden, used = out if record_routes else (out, None)
        logp = token_log_probs(model, hidden[:, -R - 1 : -1], responses, temperature, with_entropy,
                               with_sum_pi_squared)
        return (logp, used) if record_routes else logp
    if with_router_stats:
        hidden, stats = model.hidden_states(input_ids, attention_mask, with_router_stats=True)
        return token_log_probs(model, hidden[:, -R - 1 : -1], responses, temperature, with_entropy), stats
    hidden = model.hidden_states(input_ids, attention_mask)[:, -R - 1 : -1]  # states that predict each response token
    return token_log_probs(model, hidden, responses, temperature, with_entropy, with_sum_pi_squared)


def response_top_k(model, input_ids, attention_mask, response_length: int, k: int):
    """(log-probs, ids) (b, R, k) of the ``k`` most probable tokens at each response position (temperature 1: the
    distillation teacher's distribution, as verl's teacher scores it)."""
    hidden = model.hidden_states(input_ids, attention_mask)[:, -response_length - 1 : -1]
    return token_top_k(model, hidden, k)


def response_values(model, input_ids, attention_mask, response_length: int):
    """Critic values of the states before each response token; (b, R) float32 (verl's slicing)."""
    return model.token_values(input_ids, attention_mask)[:, -response_length - 1 : -1]


def forward_log_probs(graphdef, params, batch: TrainBatch, *, n_micro: int, temperature: float, with_entropy: bool,
                      with_sum_pi_squared: bool = False, record_routes: bool = False, topk: int = 0):
    """Log-probs (and entropy, or the sum of squared probabilities) of the whole batch, one micro-batch at a time
    (lax.map); a MoE model replays ``batch.routed_experts`` when given; ``record_routes``: (that, the expert ids
    used (N, P + R, sparse layers, K)); ``topk`` > 0: instead the top-k (log-probs, ids) (N, R, k) of every
    response position (a distillation teacher's: it routes its own experts)."""
    model = nnx.merge(graphdef, params)
    micro = split_micro((batch.input_ids, batch.attention_mask, batch.responses, batch.routed_experts), n_micro)

    def one(m):
        *seqs, routes = m
        if topk:
            return response_top_k(model, seqs[0], seqs[1], seqs[2].shape[1], topk)
        out = response_log_probs(model, *seqs, temperature, with_entropy, with_sum_pi_squared=with_sum_pi_squared,
                                 routes=routes, record_routes=record_routes)
        out, used = out if record_routes else (out, None)
        logp, second = out
        out = (logp, second) if with_entropy or with_sum_pi_squared else logp
        return (out, used) if record_routes else out

    out = jax.lax.map(one, micro)
    return merge_micro(out)


def forward_values(graphdef, params, batch: TrainBatch, *, n_micro: int):
    model = nnx.merge(graphdef, params)
    R = batch.responses.shape[1]
    micro = split_micro((batch.input_ids, batch.attention_mask), n_micro)
    return merge_micro(jax.lax.map(lambda m: response_values(model, *m, R), micro))


def advantage_stage(token_scores, response_mask, group_ids, old_log_probs, ref_log_probs, values, kl_coef,
                    reward_baselines=None, reward_components=None, sum_pi_squared=None, rollout_is_weights=None,
                    segment_ids=None, *, estimator: str, gamma: float, lam: float,
                    norm_adv_by_std_in_grpo: bool, use_kl_in_reward: bool, kl_penalty: str,
                    reward_weights: tuple[float, ...] | None = None, reward_clip: float | None = None,
                    whiten_advantages: bool = False, advantage_clip: float | None = None):
    """Token rewards (with the optional in-reward KL), advantages and returns; jitted once per run.

    ``reward_baselines`` (N,): ReMax's greedy-rollout score of each sample's prompt (None for other estimators).
    ``reward_components`` (N, K) and ``reward_weights``: GDPO's named reward components and their weights.
    ``sum_pi_squared`` (N, R) and ``rollout_is_weights`` (N, R): the optimal token baseline's path variance.
    ``reward_clip`` bounds the scores and again the token rewards after the KL; ``whiten_advantages`` (within each
    ``segment_ids`` (N,) segment, default one) and ``advantage_clip`` follow the estimator, in ROLL's order.
    Returns (token_level_rewards, advantages, returns, current_kl).
    """
    mask = response_mask.astype(jnp.float32)
    token_scores, _ = algos.clip_symmetric(token_scores, reward_clip)
    rewards, current_kl = token_scores, jnp.zeros((), jnp.float32)
    if use_kl_in_reward:
        rewards, current_kl = algos.apply_kl_in_reward(token_scores, old_log_probs, ref_log_probs, mask, kl_coef, kl_penalty)
        rewards, _ = algos.clip_symmetric(rewards, reward_clip)
    adv, returns = algos.compute_advantages(
        estimator, token_level_rewards=rewards, response_mask=mask, group_ids=group_ids, values=values,
        gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, reward_baselines=reward_baselines,
        reward_components=reward_components, reward_weights=reward_weights, old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared, rollout_is_weights=rollout_is_weights,
    )
    if whiten_advantages:
        seg = jnp.zeros(mask.shape[0], jnp.int32) if segment_ids is None else segment_ids
        adv = algos.whiten_by_segment(adv, mask, seg) * mask
    adv, _ = algos.clip_symmetric(adv, advantage_clip)
    return rewards, adv, returns, current_kl


@dataclasses.dataclass(frozen=True)
class ActorLossSpec:
    """Static settings of the actor loss (hashable: part of the jit cache key), from a finalized config."""

    loss_mode: str
    loss_agg_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    temperature: float
    use_old_log_probs: bool  # False: one mini-batch x one epoch, old = current (ratio 1)
    norm_constant: float | None
    options: tuple[tuple[str, Any], ...] = ()  # extra policy-loss options, e.g. (("clip_cov_ratio", 2e-4),)
    # Mixture-of-Experts actor: weight of the router load-balancing loss (0: router metrics only); None: dense actor.
    router_aux_loss_coef: float | None = None
    # A value head on the actor's trunk (critic.shared_trunk): its clipped value loss, times vf_coef, joins the
    # actor loss, computed from the same forward pass. None: a separate critic (or none).
    value: CriticLossSpec | None = None
    vf_coef: float = 0.0
    # On-policy distillation (ref_log_probs are the teacher's): its loss joins the actor loss, or replaces it
    # without task rewards. None: no distillation.
    distill: DistillSpec | None = None


@dataclasses.dataclass(frozen=True)
class CriticLossSpec:
    """Static settings of the value loss, from a finalized config."""

    cliprange_value: float
    loss_agg_mode: str
    norm_constant: float | None


# Metrics that are losses already divided by the mini-batch denominator (or weighted by the micro-batch's
# share): summed over micro-batches.
SUMMED_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "critic/vf_loss", "actor/router_aux_loss",
                  "train/loss", "distillation/loss")
EXPERT_LOAD = "actor/expert_load/"  # + expert index: its fraction of the router's top-k assignments (summed too)


def is_summed(name: str) -> bool:
    return name in SUMMED_METRICS or name.startswith(EXPERT_LOAD)


def _weighted_metrics(metrics_per_micro: dict, weights) -> dict:
    """Combine per-micro-batch means into mini-batch means, weighting by each micro-batch's token share."""
    return {k: jnp.sum(v * weights) for k, v in metrics_per_micro.items()}


def combine_micro_metrics(per_micro: list[dict], tokens: list) -> dict:
    """Mini-batch metrics from per-micro-batch ones: losses (already over the mini-batch denominator)
    are summed, the rest averaged with each micro-batch's token share as weight."""
    weights = jnp.stack(tokens) / jnp.maximum(jnp.sum(jnp.stack(tokens)), 1.0)
    out = {}
    for k in per_micro[0]:
        values = jnp.stack([m[k] for m in per_micro])
        out[k] = jnp.sum(values) if is_summed(k) else jnp.sum(values * weights)
    return out


def apply_update(tx, params, opt_state, grads):
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    # A non-finite gradient skips the update instead of poisoning the weights.
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    return keep(new_params, params), keep(new_opt_state, opt_state), grad_norm


def actor_loss(spec: ActorLossSpec, logp, ent, m: TrainBatch, m_mask, den, den_plain, key, student_topk=None):
    """The actor loss of one micro-batch from its (b, R) log-probs and entropies, with mini-batch denominators.

    ``m`` holds the micro-batch's old_log_probs, advantages (and ref_log_probs, or the teacher's top-k); ``m_mask``
    its response mask; ``student_topk`` (b, R, k) the log-probs at the teacher's top-k tokens. Returns (loss,
    metrics).
    """
    old = m.old_log_probs if spec.use_old_log_probs else jax.lax.stop_gradient(logp)
    options = dict(spec.options)
    if spec.loss_mode == "clip_cov":
        options["rng"] = key
    if m.rollout_is_weights is not None:  # algorithm.rollout_correction.rollout_is
        options["rollout_is_weights"] = m.rollout_is_weights
    pg_loss, pg_metrics = algos.policy_loss(
        spec.loss_mode, old_log_prob=old, log_prob=logp, advantages=m.advantages, response_mask=m_mask,
        loss_agg_mode=spec.loss_agg_mode, clip_ratio_low=spec.clip_ratio_low, clip_ratio_high=spec.clip_ratio_high,
        clip_ratio_c=spec.clip_ratio_c, denominator=den, norm_constant=spec.norm_constant, **options,
    )
    # Entropy is always computed: it is the actor/entropy metric even without a bonus. Without a bonus
    # its gradient is cut here: 0 * entropy would still differentiate a softmax over the vocabulary
    # (about a tenth of the vocabulary projection's backward), for a gradient of exactly zero.
    if not spec.entropy_coeff:
        ent = jax.lax.stop_gradient(ent)
    entropy = algos.agg_loss(ent, m_mask, spec.loss_agg_mode, denominator=den_plain, norm_constant=spec.norm_constant)
    loss = pg_loss - spec.entropy_coeff * entropy
    aux = {"actor/pg_loss": pg_loss, "actor/entropy": entropy}
    if spec.use_kl_loss:  # (never with distillation: ref_log_probs are then the teacher's)
        kl = algos.kl_loss(logp, m.ref_log_probs, m_mask, spec.kl_loss_type, spec.loss_agg_mode,
                           denominator=den_plain, norm_constant=spec.norm_constant)
        loss = loss + spec.kl_loss_coef * kl
        aux["actor/kl_loss"] = kl
    for name, value in pg_metrics.items():  # a named group of its own (bypass mode's rollout_corr/) keeps its name
        aux[name if "/" in name else f"actor/{name}"] = value
    if spec.distill is not None:
        d = spec.distill
        d_loss, d_metrics = algos.distillation_loss(d, logp, old, m.ref_log_probs, m_mask, spec.loss_agg_mode,
                                                    denominator=den_plain, norm_constant=spec.norm_constant,
                                                    student_topk_log_probs=student_topk,
                                                    teacher_topk_log_probs=m.teacher_topk_log_probs)
        loss = loss + d.coef * d_loss if d.use_task_rewards else d_loss  # verl: the task's loss is dropped
        aux.update({f"distillation/{k}": v for k, v in d_metrics.items()})
        aux["distillation/loss"] = d_loss
    return loss, aux


def add_router_loss(spec: ActorLossSpec, loss, metrics: dict, stats, share):
    """The actor loss plus the router load-balancing loss of one micro-batch, weighted by ``share`` (its part of the
    mini-batch's response tokens), and the router metrics (aux loss, each expert's share of the assignments)."""
    aux_loss = load_balancing_loss(stats)
    load = stats.counts_X / jnp.maximum(jnp.sum(stats.counts_X), 1.0)
    metrics = {**metrics, "actor/router_aux_loss": share * aux_loss}
    metrics.update({f"{EXPERT_LOAD}{e}": share * load[e] for e in range(load.shape[0])})
    if spec.router_aux_loss_coef:
        loss = loss + spec.router_aux_loss_coef * share * aux_loss
    return loss, metrics


def add_value_loss(spec: ActorLossSpec, vpreds, m: TrainBatch, m_mask, value_den, loss, metrics: dict):
    """The actor loss plus ``vf_coef`` x the shared value head's clipped loss of ``vpreds`` (its values of the
    states that predict each response token, from the actor's own forward pass), and the critic metrics."""
    vloss, vmetrics = critic_loss(spec.value, vpreds, m, m_mask, value_den)
    return loss + spec.vf_coef * vloss, {**metrics, **vmetrics}


def value_denominator(spec: ActorLossSpec, mask):
    """The shared value head's loss denominator over a whole mini-batch mask (None without one)."""
    if spec.value is None:
        return None
    return algos.loss_denominator(mask, spec.value.loss_agg_mode, norm_constant=spec.value.norm_constant)


def actor_denominators(spec: ActorLossSpec, mask):
    """(policy-loss denominator, plain-mode denominator) of a whole mini-batch mask."""
    agg_mode = algos.effective_loss_agg_mode(spec.loss_mode, spec.loss_agg_mode)
    return (algos.loss_denominator(mask, agg_mode, norm_constant=spec.norm_constant),
            algos.loss_denominator(mask, spec.loss_agg_mode, norm_constant=spec.norm_constant))


def actor_update(graphdef, tx, spec: ActorLossSpec, params, frozen, opt_state, mb: TrainBatch, rng, *, n_micro: int):
    """One optimizer step on one mini-batch, accumulating gradients over ``n_micro`` micro-batches.

    ``params`` are the trained parameters (differentiated, updated), ``frozen`` the rest (constant)."""
    mask = mb.response_mask.astype(jnp.float32)
    den, den_plain = actor_denominators(spec, mask)
    value_den = value_denominator(spec, mask)
    micro = split_micro(mb, n_micro)
    tokens = jnp.sum(split_micro(mask, n_micro), axis=(1, 2))
    weights = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
    rngs = jax.random.split(rng, n_micro)
    R = mb.responses.shape[1]
    moe = spec.router_aux_loss_coef is not None

    def micro_step(grad_acc, xs):
        m, key = xs

        def loss_fn(p):
            model = nnx.merge(graphdef, p, frozen)
            m_mask = m.response_mask.astype(jnp.float32)
            out = model.hidden_states(m.input_ids, m.attention_mask, with_router_stats=moe, routes=m.routed_experts)
            hidden, stats = out if moe else (out, None)
            hidden = hidden[:, -R - 1 : -1]  # the states that predict each response token
            logp, ent, *topk = token_log_probs(model, hidden, m.responses, spec.temperature, True,
                                               at_ids=m.teacher_topk_ids)
            loss, metrics = actor_loss(spec, logp, ent, m, m_mask, den, den_plain, key, *topk)
            if moe:
                loss, metrics = add_router_loss(spec, loss, metrics, stats,
                                                jnp.sum(m_mask) / jnp.maximum(jnp.sum(mask), 1.0))
            if spec.value is not None:
                loss, metrics = add_value_loss(spec, model.values_from_hidden(hidden), m, m_mask, value_den, loss,
                                               metrics)
            return loss, metrics

        (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return jax.tree.map(jnp.add, grad_acc, grads), aux

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, aux = jax.lax.scan(micro_step, zeros, (micro, rngs))
    summed = {k: jnp.sum(v) for k, v in aux.items() if is_summed(k)}
    averaged = _weighted_metrics({k: v for k, v in aux.items() if k not in summed}, weights)
    params, opt_state, grad_norm = apply_update(tx, params, opt_state, grads)
    return params, opt_state, {**summed, **averaged, "actor/grad_norm": grad_norm}


def critic_loss(spec: CriticLossSpec, vpreds, m: TrainBatch, m_mask, den):
    loss, clipfrac = algos.value_loss(vpreds, m.values, m.returns, m_mask, spec.cliprange_value,
                                      spec.loss_agg_mode, denominator=den, norm_constant=spec.norm_constant)
    vpred_mean = algos.masked_mean(vpreds, m_mask.astype(jnp.float32))
    return loss, {"critic/vf_loss": loss, "critic/vf_clipfrac": clipfrac, "critic/vpred_mean": vpred_mean}


def critic_update(graphdef, tx, spec: CriticLossSpec, params, frozen, opt_state, mb: TrainBatch, *, n_micro: int):
    """One critic optimizer step on one mini-batch (clipped value loss)."""
    mask = mb.response_mask.astype(jnp.float32)
    den = algos.loss_denominator(mask, spec.loss_agg_mode, norm_constant=spec.norm_constant)
    micro = split_micro(mb, n_micro)
    tokens = jnp.sum(split_micro(mask, n_micro), axis=(1, 2))
    weights = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
    R = mb.responses.shape[1]

    def micro_step(grad_acc, m):
        def loss_fn(p):
            model = nnx.merge(graphdef, p, frozen)
            vpreds = response_values(model, m.input_ids, m.attention_mask, R)
            return critic_loss(spec, vpreds, m, m.response_mask, den)

        (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return jax.tree.map(jnp.add, grad_acc, grads), aux

    grads, aux = jax.lax.scan(micro_step, jax.tree.map(jnp.zeros_like, params), micro)
    metrics = {"critic/vf_loss": jnp.sum(aux["critic/vf_loss"])}
    metrics.update(_weighted_metrics({k: v for k, v in aux.items() if k != "critic/vf_loss"}, weights))
    params, opt_state, grad_norm = apply_update(tx, params, opt_state, grads)
    return params, opt_state, {**metrics, "critic/grad_norm": grad_norm}
