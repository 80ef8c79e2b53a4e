"""The RL trainer: one step is produce (sample and score a prompt batch: train/trainer_rollout.py) -> prepare
(old/ref log-probs, values, advantages: train/prepare.py) -> update (critic and actor: train/update.py).

``Trainer(cfg).fit()`` runs ``trainer.total_training_steps`` steps (or the epochs' worth) in the run loop shared
with SFT and DPO (train/fit_loop.py): validation every ``trainer.test_freq`` steps and checkpoints every
``trainer.save_freq`` steps, both also at the last step (verl's meaning: <= 0 never; None, the default, only at
the end), a Hugging Face export per ``trainer.save_hf_checkpoint`` when it saves, resume from the latest complete
checkpoint (``trainer.resume_mode=auto``), and a clean stop with a checkpoint on SIGTERM or SIGINT. Batches are
produced ahead of training in rounds (train/trainer_experience.py).

Randomness is a pure function of (trainer.seed, step): the sampler's key and the update key are derived from
them, so a resumed run draws what the uninterrupted run would have drawn.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from rlhf_jax import algos
from rlhf_jax.agents.multi_turn import multi_turn_rollout
from rlhf_jax.algos.rollout_correction import correction_from_config, mismatch_metrics, rollout_correction
from rlhf_jax.models.hub import resolve_model_path
from rlhf_jax.data import loader_from_config
from rlhf_jax.models import TASK_TOKEN_VALUE
from rlhf_jax.rollout import Sampler
from rlhf_jax.train import experience, losses
from rlhf_jax.train import metrics as M
from rlhf_jax.parallel.hosts import gather_all
from rlhf_jax.train.engine import Role
from rlhf_jax.train.fit_loop import RunLoop
from rlhf_jax.train.optim import make_optimizer
from rlhf_jax.train.pass_bound import needs_compile, role_pass_bound
from rlhf_jax.train.passes import (HEADROOM, PassPlan, compile_pass, describe, fit_pass, free_device_memory, gib,
                                   held_bytes, pass_batch, pass_bytes, plan_passes, step_correction, step_passes)
from rlhf_jax.runtime.oom import memory_hint
from rlhf_jax.train.prepare import Prepared, Preparer, ScoreShaping
from rlhf_jax.runtime.preemption import STOP, StopRequest
from rlhf_jax.train.setup import (Components, actor_role, load_policy, offload_flags, prepare, reference_role,
                                  sampler_graphdef)
from rlhf_jax.train.steps import ActorLossSpec, CriticLossSpec, advantage_stage
from rlhf_jax.train.trainer_checkpoints import (CheckpointItems, export_policy, model_record, restore_roles,
                                                role_arrays)
from rlhf_jax.train.split_run import experience_buffer, split_groups
from rlhf_jax.train.trainer_rollout import Producer, Rollouts, scorers
from rlhf_jax.train.update import UpdateSchedule, update_role
from rlhf_jax.train.validation import Validator
from rlhf_jax.parallel import batch_sharding
from rlhf_jax.types import PromptBatch, ScoredBatch

log = logging.getLogger(__name__)



def gdpo_keys(cfg: ConfigDict) -> tuple[str, ...]:
    """The reward components GDPO normalises (algorithm.gdpo_reward_keys); () for every other estimator."""
    alg = cfg.algorithm
    return tuple(alg.gdpo_reward_keys) if alg.adv_estimator == "gdpo" and alg.gdpo_reward_keys else ()


def router_aux_loss_coef(cfg: ConfigDict, model_cfg) -> float | None:
    """The weight of the router load-balancing loss of a Mixture-of-Experts actor (None for a dense one).

    Unset, it is the checkpoint's ``router_aux_loss_coef`` when its config has ``output_router_logits`` (the
    switch with which transformers adds the loss to the training loss), else 0 (router metrics only).
    """
    setting = cfg.actor_rollout_ref.actor.router_aux_loss_coef
    if model_cfg is None or not any(model_cfg.sparse_layers):
        if setting:
            raise ValueError(f"actor_rollout_ref.actor.router_aux_loss_coef={setting} applies to Mixture-of-Experts "
                             "models; the actor has no expert layers (unset it)")
        return None
    if setting is not None:
        return float(setting)
    hf = model_cfg.hf_config
    return float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0


def actor_loss_spec(cfg: ConfigDict, recompute_old: bool, temperature: float, model_cfg=None) -> ActorLossSpec:
    """The actor loss settings; ``model_cfg`` (the actor's ModelConfig) decides the router loss of a MoE actor."""
    a = cfg.actor_rollout_ref.actor
    if a.router_replay.mode != "disabled" and (model_cfg is None or not any(model_cfg.sparse_layers)):
        raise ValueError(f"actor_rollout_ref.actor.router_replay.mode={a.router_replay.mode} replays "
                         "Mixture-of-Experts routes; the actor has no expert layers (set it to disabled)")
    pl = a.policy_loss
    spec = ActorLossSpec(
        router_aux_loss_coef=router_aux_loss_coef(cfg, model_cfg),
        loss_mode=pl.loss_mode, loss_agg_mode=a.loss_agg_mode,
        clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c, entropy_coeff=a.entropy_coeff, use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, temperature=temperature,
        use_old_log_probs=recompute_old, norm_constant=a.loss_scale_factor,
        options=tuple(sorted(dict(clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb, clip_cov_ub=pl.clip_cov_ub,
                                  kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef).items()))
        if pl.loss_mode in ("clip_cov", "kl_cov")
        else (("tau_neg", a.tau_neg), ("tau_pos", a.tau_pos)) if pl.loss_mode == "sapo"
        else (("dro_beta", pl.dro_beta),) if pl.loss_mode == "dro" else (),
    )
    dist = cfg.distillation
    if dist.enabled:  # ref_log_probs (or the teacher_topk_* fields) are the teacher's
        dl = dist.distillation_loss
        spec = dataclasses.replace(spec, distill=algos.DistillSpec(
            loss_mode=dl.loss_mode, use_task_rewards=bool(dl.use_task_rewards), coef=float(dl.distillation_loss_coef),
            loss_max_clamp=dl.loss_max_clamp, use_policy_gradient=bool(dl.use_policy_gradient),
            clip_ratio_low=float(dl.clip_ratio_low), clip_ratio_high=float(dl.clip_ratio_high),
            log_prob_min_clamp=None if dl.log_prob_min_clamp is None else float(dl.log_prob_min_clamp)))
    corr = cfg.algorithm.rollout_correction
    if corr.bypass_mode:  # old = the sampler's log-probs; the loss applies the correction (algos.bypass)
        spec = dataclasses.replace(spec, loss_mode="bypass_mode", use_old_log_probs=True, options=(
            ("correction", correction_from_config(corr, a.tis_imp_ratio_cap)), ("loss_type", corr.loss_type)))
    return spec


class Trainer:
    """The RL trainer (the ``fit_loop.Trainer`` protocol)."""

    def __init__(self, cfg: ConfigDict, components: Components | None = None, stop: StopRequest = STOP,
                 lock_dir: bool = False):
        """``lock_dir``: refuse at once if another run uses the output directory (``fit`` always checks)."""
        c = components or prepare(cfg)
        self.c, self.cfg, self.stop = c, c.cfg, stop
        cfg, d, a = self.cfg, self.cfg.derived, self.cfg.actor_rollout_ref.actor
        separate_critic = bool(cfg.critic.enable and not cfg.critic.shared_trunk)
        critic_ckpt = cfg.critic.checkpoint if separate_critic else None
        self.loop = RunLoop(cfg, stop, lock_dir, max_to_keep=cfg.trainer.max_actor_ckpt_to_keep, checkpoint_contents=(
            tuple(a.checkpoint.save_contents), tuple(a.checkpoint.load_contents),
            tuple(critic_ckpt.save_contents) if critic_ckpt else None,
            tuple(critic_ckpt.load_contents) if critic_ckpt else None))
        # before the models: the per-domain shares are checked against the data first
        self.loader = loader_from_config(cfg.data, c.tokenizer, "train", num_epochs=None, dataset=c.train_dataset)
        if self.loader.domains is not None:
            self.loop.logger.text(f"training prompts by domain (data.domain_weights): {self.loader.domains.describe()}")
        self.actor = actor_role(cfg, c, self.loop.total_steps, d.actor_updates_per_step)
        self.ref = reference_role(cfg, c, self.actor) if d.need_ref else None
        self.critic = self._critic(cfg, c) if separate_critic else None  # else the actor may carry the value head
        self.rollouts = self._rollouts(cfg, c)
        self.producer = Producer(self.rollouts, c.sampling, cfg.algorithm.filter_groups,
                                 greedy_baseline=algos.estimator_info(cfg.algorithm.adv_estimator).needs_greedy_baseline,
                                 rollout_data_dir=cfg.trainer.rollout_data_dir, loader=self.loader, stop=stop,
                                 component_keys=gdpo_keys(cfg))
        self.experience = experience_buffer(cfg, c, self.loop.total_steps, self.loader, self.producer.produce,
                                            self.rollouts)
        self.validator = None if c.val_dataset is None else Validator(
            self.rollouts, lambda: loader_from_config(cfg.data, c.tokenizer, "val", dataset=c.val_dataset),
            c.val_dataset, c.val_sampling, stop, self.loop.logger, cfg.trainer.log_val_generations,
            cfg.trainer.validation_data_dir, self.loop.is_main)
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algos.init_kl_controller(kc.kl_coef, kc.type, kc.target_kl, kc.horizon)
        self.critic_loss, self.actor_loss = self._losses(cfg, c)
        correction = step_correction(cfg, correction_from_config(cfg.algorithm.rollout_correction,
                                                                 a.tis_imp_ratio_cap))
        self.passes = step_passes(cfg, correction, use_kl_loss=self.actor_loss.spec.use_kl_loss)
        self.plans = plan_passes(cfg, actor_mlp_width=self.actor.config.intermediate_size,
                                 critic_mlp_width=self.critic.config.intermediate_size if self.critic else None)
        self.prepare = self._preparer(cfg, c, correction)
        self.schedules = {
            "update_actor": UpdateSchedule(self.passes.fields("update_actor"), a.ppo_epochs,
                                           d.actor_num_mini_batches, a.shuffle, salt=0),
            "update_critic": UpdateSchedule(self.passes.fields("update_critic"), cfg.critic.ppo_epochs,
                                            d.critic_num_mini_batches, cfg.critic.shuffle, salt=1)}
        self.num_params = sum(x.size for x in jax.tree.leaves(self.actor.state()))
        self._size_keys: tuple[str, ...] | None = None

    # ------------------------------------------------------------------ construction
    def _critic(self, cfg: ConfigDict, c: Components) -> Role:
        """A separate value model (critic.model.path, or the actor's checkpoint) with its own optimizer."""
        tx, lr = make_optimizer(cfg.critic.optim, cfg.critic.grad_clip, self.loop.total_steps,
                                cfg.derived.critic_updates_per_step)
        path = (resolve_model_path(cfg.critic.model.path, cfg.critic.model.revision) if cfg.critic.model.path
                else c.model_path)
        model = load_policy(cfg, c.model_path, c.mesh, c.rules, role="critic", task=TASK_TOKEN_VALUE, path=path)
        return Role(model, c.mesh, tx, lr, **offload_flags(cfg, "critic"))

    def _rollouts(self, cfg: ConfigDict, c: Components) -> Rollouts:
        """The sampler on the actor's weights (on the training mesh, or on mesh.rollout_devices; under LoRA the
        plain model on merged weights), the multi-turn rollout and the scorers."""
        spec = self.actor.config.lora
        graphdef = sampler_graphdef(cfg, self.actor.config, self.actor.task, None if spec else self.actor.graphdef)
        here = c.rollout_mesh if c.rollout_mesh is not None and split_groups(cfg) is None else None  # a split run
        # samples on other processes; this sampler validates on the training mesh
        sampler = Sampler(graphdef, mesh=here or c.mesh, rules=c.rules,
                          max_positions=self.actor.config.max_position_embeddings)
        multi_turn = multi_turn_rollout(cfg, sampler.graphdef, self.actor.config, c.tokenizer, c.mesh, c.rules,
                                        sampling_mesh=here)
        rewards, reward_model = scorers(cfg, here or c.mesh, c.rules)
        return Rollouts(self.actor, sampler, c.tokenizer, rewards, mesh=c.mesh, rules=c.rules,
                        dp_size=cfg.derived.dp_size, reward_model=reward_model, multi_turn=multi_turn,
                        rollout_mesh=here, weight_dtype=cfg.actor_rollout_ref.rollout.weight_dtype,
                        compute_dtype=cfg.actor_rollout_ref.rollout.dtype)

    def _losses(self, cfg: ConfigDict, c: Components) -> tuple[losses.Loss, losses.Loss]:
        """(critic, actor) losses; under critic.shared_trunk the value loss joins the actor's."""
        critic_spec = CriticLossSpec(cfg.critic.cliprange_value, cfg.critic.loss_agg_mode,
                                     cfg.actor_rollout_ref.actor.loss_scale_factor)
        spec = actor_loss_spec(cfg, cfg.derived.recompute_old_log_prob, c.sampling.logprob_temperature,
                               self.actor.config)
        if cfg.critic.enable and cfg.critic.shared_trunk:
            spec = dataclasses.replace(spec, value=critic_spec, vf_coef=float(cfg.critic.vf_coef))
        return losses.critic(critic_spec), losses.actor(spec)

    def _preparer(self, cfg: ConfigDict, c: Components, correction) -> Preparer:
        alg = cfg.algorithm
        advantage_fn = jax.jit(functools.partial(
            advantage_stage, estimator=alg.adv_estimator, gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, use_kl_in_reward=alg.use_kl_in_reward,
            kl_penalty=alg.kl_penalty,
            reward_weights=tuple(map(float, alg.gdpo_reward_weights)) if alg.gdpo_reward_weights else None,
            reward_clip=alg.reward_clip, whiten_advantages=alg.whiten_advantages, advantage_clip=alg.advantage_clip))
        mask = alg.sample_mask
        shaping = ScoreShaping(
            norm_mean=alg.reward_norm.mean, norm_std=alg.reward_norm.std, truncated=mask.truncated,
            difficulty=(mask.difficulty_low, mask.difficulty_high) if mask.difficulty else None,
            max_length=int(cfg.actor_rollout_ref.rollout.response_length))
        return Preparer(self.passes, self.plans, self.actor, self.ref, self._role_of("values"), correction,
                        jax.jit(functools.partial(rollout_correction, cfg=correction)), jax.jit(mismatch_metrics),
                        advantage_fn,
                        self.actor_loss.spec.temperature, c.sampling.n, c.mesh, cfg.derived.dp_size,
                        int(c.sampling.pad_token_id), self.stop, shaping,
                        router_replay=cfg.actor_rollout_ref.actor.router_replay.mode)

    def _role_of(self, name: str) -> Role | None:
        values = self.actor if self.passes.values == "actor" else self.critic
        return {"old_log_prob": self.actor, "ref": self.ref, "values": values, "update_actor": self.actor,
                "update_critic": self.critic}[name]

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, Any]:
        """Training step ``step`` + 1: the oldest produced batch trained on (producing the rounds that fall due)."""
        self.plan_memory()
        return self.experience.train_next(step, self.rollouts.weights, functools.partial(self.learn, step=step))

    def train_on(self, pb: PromptBatch, step: int) -> dict[str, Any]:
        """Step ``step`` + 1 on the prompt batch ``pb``, sampled now (how benchmarks and tests drive single steps:
        the loader's fetch stays outside the step's time)."""
        self.plan_memory()
        timer = M.Timer()
        with timer("step"):
            scored = self.producer.produce(pb, step, version=step)
        return self.learn(scored, timer, step)

    def learn(self, scored: ScoredBatch, timer: M.Timer, step: int) -> dict[str, Any]:
        """prepare -> update on one produced batch; ``timer`` is the step's (its "step" phase may already hold
        the batch's production)."""
        self.plan_memory()
        metrics = {**scored.metrics, **M.version_metrics(scored.version, scored.rollout.versions, step)}
        with timer("step"):
            prepared = self.prepare(scored, self.kl_ctrl["value"], timer)
            metrics.update(prepared.metrics)
            if self.cfg.algorithm.use_kl_in_reward:
                metrics.update({"actor/reward_kl_penalty": float(prepared.current_kl),
                                "actor/reward_kl_penalty_coeff": float(self.kl_ctrl["value"])})
                self.kl_ctrl = algos.update_kl_controller(self.kl_ctrl, prepared.current_kl,
                                                          self.cfg.derived.rollout_batch_size)
            if self.critic is not None:
                with timer("update_critic"):
                    metrics.update(self._update("update_critic", self.critic, self.critic_loss, prepared, step))
            if step >= self.cfg.trainer.critic_warmup:
                with timer("update_actor"):
                    metrics.update(self._update("update_actor", self.actor, self.actor_loss, prepared, step))
        if prepared.batch.sum_pi_squared is not None:
            b = prepared.batch
            weights = None if b.rollout_is_weights is None else gather_all(b.rollout_is_weights)
            metrics.update(M.variance_proxy_metrics(
                gather_all(b.old_log_probs), gather_all(b.sum_pi_squared), gather_all(b.advantages),
                gather_all(b.response_mask), weights, metrics.get("actor/grad_norm")))
        return metrics | self._step_metrics(scored, prepared, timer, step)

    def _update(self, name: str, role: Role, loss: losses.Loss, prepared: Prepared, step: int) -> dict[str, float]:
        metrics = update_role(role, loss, prepared.layouts[name], prepared.batch, self.schedules[name],
                              mesh=self.c.mesh, seed=int(self.cfg.trainer.seed), step=step)
        jax.block_until_ready(role.params)
        return metrics

    def _step_metrics(self, scored: ScoredBatch, prepared: Prepared, timer: M.Timer, step: int) -> dict[str, Any]:
        """Data, timing and throughput metrics over every process's rows (gathered after the step's timer: they
        are not part of the step)."""
        cfg, d, batch = self.cfg, self.cfg.derived, prepared.batch
        arrays = {k: gather_all(getattr(batch, k)) for k in ("advantages", "returns", "values")
                  if getattr(batch, k) is not None}
        arrays["response_mask"] = gather_all(prepared.sampled_mask)  # what was sampled, before any rejection
        arrays.update(token_level_scores=gather_all(prepared.token_scores),
                      token_level_rewards=gather_all(prepared.rewards), prompt_mask=prepared.host["prompt_mask"])
        out = prepared.packer.metrics()
        out.update(M.data_metrics(arrays, max_prompt_length=cfg.data.max_prompt_length,
                                  max_response_length=cfg.actor_rollout_ref.rollout.response_length))
        resp_tokens = int(arrays["response_mask"].sum())
        total_tokens = resp_tokens + int(arrays["prompt_mask"].sum())
        seconds = {k[len("timing_s/"):]: v for k, v in scored.metrics.items() if k.startswith("timing_s/")}
        for k, v in timer.seconds.items():  # the production's stages plus this step's own
            seconds[k] = seconds.get(k, 0.0) + v
        out.update(M.timing_metrics(seconds, response_tokens=resp_tokens, total_tokens=total_tokens))
        out.update(M.perf_metrics(total_tokens=total_tokens, step_seconds=timer.seconds["step"],
                                  update_seconds=timer.seconds.get("update_actor", 0.0), num_params=self.num_params,
                                  ppo_epochs=cfg.actor_rollout_ref.actor.ppo_epochs,
                                  num_devices=d.num_devices + cfg.mesh.rollout_devices))
        out["actor/kl_coef"] = float(cfg.actor_rollout_ref.actor.kl_loss_coef)
        out["actor/lr"] = float(self.actor.lr_fn(step))
        if self.critic is not None:
            out["critic/lr"] = float(self.critic.lr_fn(step))
        out["training/global_step"] = step + 1
        out["training/epoch"] = scored.prompts.epoch
        return out

    # ------------------------------------------------------------------ memory plan
    def plan_memory(self) -> tuple[str, ...]:
        """Compile every pass the step runs before the first step, size automatic (-1) micro-batches to the largest
        that XLA's memory estimate fits, and stop with the keys to change when a size the user set cannot fit."""
        if self._size_keys is not None:
            return self._size_keys
        free, cfg = free_device_memory(), self.cfg
        for name, plan in list(self.plans.items()):
            if not self.passes.runs(name):
                continue
            role = self._role_of(name)
            bound = role_pass_bound(plan, role, gradient=name.startswith("update"))
            if needs_compile(bound, free, HEADROOM):
                hint = memory_hint(cfg, "critic" if role is self.critic else "actor")
                held = held_bytes(role, name)
                plan, need = fit_pass(plan, functools.partial(self.compile_pass, name), free, hint,
                                      lambda compiled, held=held: pass_bytes(compiled, held))
                self.plans[name] = plan
                estimate = f"~{gib(need)} per device" if need is not None else "no estimate on this backend"
            else:  # far from the memory there is: compiling it to know would change nothing
                estimate = f"at most {gib(bound)} per device by the model's arithmetic"
            self.loop.logger.text(f"memory plan: {name}: micro-batches of {describe(plan)} per shard, {estimate}"
                                  + (f" ({gib(free)} free)" if free is not None else ""))
        self._size_keys = tuple(k for p in self.plans.values() for k in p.size_keys)
        return self._size_keys

    def compile_pass(self, name: str, plan: PassPlan):
        """Pass ``name`` compiled at ``plan`` for the largest batch the config allows (what the memory plan reads)."""
        loss = {"update_actor": self.actor_loss, "update_critic": self.critic_loss}.get(name)
        return compile_pass(name, self._role_of(name), plan, pass_batch(self.cfg, self.passes, name, plan.packed),
                            dp=self.cfg.derived.dp_size, temperature=self.actor_loss.spec.temperature, loss=loss,
                            sum_pi_squared=self.passes.sum_pi_squared, teacher_topk=self.passes.teacher_topk,
                            router_replay=self.passes.router_replay)

    # ------------------------------------------------------------------ the loop's other calls
    def validate(self, step: int) -> dict[str, float]:
        return self.validator(step) if self.validator is not None else {}

    def checkpoint_items(self, saved: dict | None = None) -> CheckpointItems:
        """The roles' arrays; with the actor's "extra": the KL coefficient, the data position and the batches
        produced but not yet trained on."""
        if saved is None:
            pending, described, data_state = self.experience.checkpoint()
        else:  # restore targets of the checkpoint's pending batches
            described, data_state = saved.get("pending", []), None
            pending = experience.templates(described, lambda ndim: batch_sharding(self.c.mesh, ndim, self.c.rules))
        state = {"kl_coef": float(self.kl_ctrl["value"]), "data_state": data_state, "pending": described}
        return CheckpointItems(role_arrays(self.actor, self.critic), model_record(self.actor, self.cfg, self.c), state,
                               required=("data_state", "kl_coef"), state_arrays={"experience": pending})

    def restore(self, arrays: dict[str, Any], state: dict | None) -> None:
        restore_roles(arrays, self.actor, self.critic)
        if state is not None:
            self.kl_ctrl = {**self.kl_ctrl, "value": jnp.asarray(state["kl_coef"], jnp.float32)}
            self.loader.set_state(state["data_state"])
            self.experience.restore(arrays.get("experience", {}), state.get("pending", []))

    def export_hf(self, step: int) -> str:
        return export_policy(self.actor, self.loop.out_dir, step, self.c.tokenizer, self.c.model_path)

    def fit(self) -> dict[str, Any]:
        return self.loop.fit(self)

    def out_of_memory(self, error: BaseException) -> str | None:
        return self.loop.out_of_memory(error)

    def close(self) -> None:
        self.experience.close()
        self.rollouts.close()
        self.loop.close()
