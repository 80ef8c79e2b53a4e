"""The RL trainer: sample, score, old/ref log-probs and values, advantages, critic and actor updates.

The rollout side lives in train/trainer_rollout.py, checkpoints in trainer_checkpoints.py, the experience buffer
and overlap in trainer_experience.py, and the run loop (shared with SFT and DPO) in fit_loop.py.

``Trainer(cfg).fit()`` runs ``trainer.total_training_steps`` steps (or the
epochs' worth), validating every ``trainer.test_freq`` steps and checkpointing
every ``trainer.save_freq`` steps, both also at the last step (verl's meaning:
<= 0 never; None, the default, only at the end), and exporting a Hugging Face
directory per ``trainer.save_hf_checkpoint`` when it saves. A run resumes from the latest
complete checkpoint (``trainer.resume_mode=auto``). SIGTERM or SIGINT ends the run
cleanly with a checkpoint of the last finished step (``train/preemption.py``).

Randomness is a pure function of (trainer.seed, step): the sampler's key and the
update key are derived from them, so a resumed run draws what the uninterrupted
run would have drawn.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from rlhf_jax import algos
from rlhf_jax.algos.rollout_correction import correction_from_config, rollout_correction
from rlhf_jax.config import resolve_model_path
from rlhf_jax.data import PromptBatch, loader_from_config

from rlhf_jax.models import TASK_TOKEN_VALUE
from rlhf_jax.rewards import RewardManager, place_on_last_token
from rlhf_jax.rollout import Sampler
from rlhf_jax.batch import pack_batch, trim_columns
from rlhf_jax.train import metrics as M
from rlhf_jax.train.batching import gather_all, mini_batches, sum_over_processes, to_global, to_local
from rlhf_jax.train.checkpoint import Checkpointer
from rlhf_jax.train.engine import Role
from rlhf_jax.train.experience import Experience
from rlhf_jax.train.fit_loop import FitLoop
from rlhf_jax.train.trainer_checkpoints import CheckpointMixin
from rlhf_jax.train.trainer_experience import ExperienceMixin
from rlhf_jax.train.trainer_rollout import RolloutMixin
from rlhf_jax.train.generation import key_function
from rlhf_jax.train.loggers import MetricLogger, dump_generations
from rlhf_jax.train.optim import make_optimizer
from rlhf_jax.train.profiling import StepProfiler
from rlhf_jax.train.preemption import STOP, StepAbandoned, StopRequest
from rlhf_jax.train.passes import (PassPlan, compile_pass, describe, fit_pass, free_device_memory, gib, held_bytes,
                                  memory_hint, pass_bytes, plan_passes)
from rlhf_jax.train.setup import (Components, actor_role, load_policy, prepare, reference_role,
                                  sampler_graphdef)
from rlhf_jax.train.steps import ActorLossSpec, CriticLossSpec, advantage_stage

log = logging.getLogger(__name__)



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
    pl = a.policy_loss
    return ActorLossSpec(
        router_aux_loss_coef=router_aux_loss_coef(cfg, model_cfg),
        loss_mode=pl.loss_mode, loss_agg_mode=a.loss_agg_mode,
        clip_ratio_low=a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio,
        clip_ratio_high=a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio,
        clip_ratio_c=a.clip_ratio_c, entropy_coeff=a.entropy_coeff, use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, temperature=temperature,
        use_old_log_probs=recompute_old, norm_constant=a.loss_scale_factor,
        options=tuple(sorted(dict(clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb, clip_cov_ub=pl.clip_cov_ub,
                                  kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef).items()))
        if pl.loss_mode in ("clip_cov", "kl_cov") else (),
    )


class Trainer(FitLoop, RolloutMixin, CheckpointMixin, ExperienceMixin):
    def __init__(self, cfg: ConfigDict, components: Components | None = None, stop: StopRequest = STOP,
                 lock_dir: bool = False):
        """``lock_dir``: refuse at once if another run uses the output directory (``fit`` always checks)."""
        self.stop = stop  # SIGTERM/SIGINT: see train/preemption.py
        c = components or prepare(cfg)
        self.c, self.cfg, self.mesh, self.tok = c, c.cfg, c.mesh, c.tokenizer
        cfg, d = self.cfg, self.cfg.derived
        self.total_steps = int(d.total_training_steps)
        self._open_output(lock_dir)
        arr = cfg.actor_rollout_ref
        self.actor = actor_role(cfg, c, self.total_steps, d.actor_updates_per_step)
        self.lora = self.actor.config.lora
        self.ref = reference_role(cfg, c, self.actor) if d.need_ref else None
        self.critic = None  # a separate value model; under critic.shared_trunk the actor carries the value head
        self.shared_value = bool(cfg.critic.enable and cfg.critic.shared_trunk)
        if cfg.critic.enable and not self.shared_value:
            ctx, clr = make_optimizer(cfg.critic.optim, cfg.critic.grad_clip, self.total_steps, d.critic_updates_per_step)
            critic_path = resolve_model_path(cfg.critic.model.path, cfg.critic.model.revision) if cfg.critic.model.path else c.model_path
            self.critic = Role(load_policy(cfg, c.model_path, self.mesh, c.rules, role="critic", task=TASK_TOKEN_VALUE,
                                           path=critic_path),
                               self.mesh, ctx, clr)
        self._key_fn = key_function(self.mesh)
        # Sampling runs on the training mesh, or on devices of its own (mesh.rollout_devices). Under LoRA it runs the
        # plain model on weights with the adapters merged in (``_sampler_params``).
        self.rollout_mesh = c.rollout_mesh
        self._rollout_params_of: tuple[Any, Any] | None = None  # (actor params, their copy on the rollout mesh)
        self.sampler = Sampler(sampler_graphdef(cfg, self.actor.config, self.actor.task,
                                                None if self.lora else self.actor.graphdef),
                               mesh=self.rollout_mesh or self.mesh, rules=c.rules,
                               max_positions=self.actor.config.max_position_embeddings)
        self._merge_fn = None
        self.multi_turn = self._multi_turn_rollout()
        self.reward_manager = RewardManager.from_config(cfg.reward_model, cfg.custom_reward_function,
                                                        max_response_length=cfg.actor_rollout_ref.rollout.response_length)
        self.reward_model = None
        if cfg.reward_model.enable:
            from rlhf_jax.rewards import RewardModelScorer

            self.reward_model = RewardModelScorer.from_config(cfg.reward_model, mesh=self.mesh, rules=c.rules)
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algos.init_kl_controller(kc.kl_coef, kc.type, kc.target_kl, kc.horizon)
        self.critic_spec = CriticLossSpec(cfg.critic.cliprange_value, cfg.critic.loss_agg_mode,
                                          arr.actor.loss_scale_factor)
        self.actor_spec = actor_loss_spec(cfg, d.recompute_old_log_prob, c.sampling.logprob_temperature,
                                          self.actor.config)
        if self.shared_value:
            self.actor_spec = dataclasses.replace(self.actor_spec, value=self.critic_spec,
                                                  vf_coef=float(cfg.critic.vf_coef))
        self.correction = correction_from_config(cfg.algorithm.rollout_correction,
                                                 cfg.actor_rollout_ref.actor.tis_imp_ratio_cap)
        self._correction_fn = jax.jit(functools.partial(rollout_correction, cfg=self.correction))
        alg = cfg.algorithm
        self._advantage_fn = jax.jit(functools.partial(
            advantage_stage, estimator=alg.adv_estimator, gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, use_kl_in_reward=alg.use_kl_in_reward,
            kl_penalty=alg.kl_penalty))
        self.loader = loader_from_config(cfg.data, self.tok, "train", num_epochs=None, dataset=c.train_dataset)
        self.profiler = StepProfiler(cfg.trainer.profile_steps, cfg.trainer.profile_dir)
        self.checkpointer = Checkpointer(os.path.join(self.out_dir, "checkpoints"),
                                         max_to_keep=cfg.trainer.max_actor_ckpt_to_keep)
        self.logger = MetricLogger(self.log_dir, cfg.trainer.logger, total_steps=self.total_steps, enabled=self.is_main,
                                   run=(cfg.trainer.project_name, cfg.trainer.experiment_name, cfg.to_dict()))
        self.step = 0
        self.num_params = sum(x.size for x in jax.tree.leaves(self.actor.state()))
        self.plans = plan_passes(cfg, actor_mlp_width=self.actor.config.intermediate_size,
                                 critic_mlp_width=self.critic.config.intermediate_size if self.critic else None)
        self._memory_planned = False
        self._layout_metrics: dict[str, float] = {}
        self._init_experience()

    # ------------------------------------------------------------------ one step
    def train_step(self, pb: PromptBatch) -> dict[str, Any]:
        """One step on a prompt batch: sample and score it now, then train on it."""
        self.plan_memory()
        timer = M.Timer()
        with timer("step"):
            experience = self._produce(pb, self.step)
        return self._learn(experience, timer)

    def _learn(self, experience: Experience, timer: M.Timer) -> dict[str, Any]:
        """Train on one produced batch: old/ref log-probs, values, advantages, critic and actor updates.
        ``timer`` is the step's (its "step" phase may already hold the batch's production)."""
        self.plan_memory()
        cfg, d, n = self.cfg, self.cfg.derived, self.c.sampling.n
        pb, out, baselines = experience.pb, experience.out, experience.baselines
        out_metrics: dict[str, Any] = dict(experience.metrics)
        out_metrics["training/weight_version"] = float(experience.version)
        out_metrics["training/staleness"] = float(self.step - experience.version)
        with timer("step"):
            host = {k: gather_all(getattr(out, k)) for k in ("prompts", "prompt_mask", "responses", "response_mask")}
            with timer("reward"):  # the reward stage's last part: each score placed on its response's last token
                token_scores = experience.scores  # (N, R) already with multi_turn.per_turn_rewards
                if token_scores.ndim == 1:
                    token_scores = jax.block_until_ready(place_on_last_token(token_scores, out.response_mask))
            host["response_valid"] = gather_all(out.valid_mask())  # the sequence's tokens (tool responses too)
            batch, rollout_logprobs = self._training_batch(out, host)
            need_old = d.recompute_old_log_prob or cfg.algorithm.use_kl_in_reward or self.correction.enabled
            if need_old:
                with timer("old_log_prob"):
                    batch["old_log_probs"] = self._forward_pass("old_log_prob", self.actor, batch, host)
                    diff = jnp.abs(batch["old_log_probs"] - rollout_logprobs) * batch["response_mask"]
                    out_metrics["training/rollout_probs_diff_mean"] = float(
                        jnp.sum(diff) / jnp.maximum(jnp.sum(batch["response_mask"]), 1))
            else:
                batch["old_log_probs"] = rollout_logprobs  # unused by the loss (ratio 1), kept for shapes
            sampled_mask = batch["response_mask"]
            if self.correction.enabled:  # before the advantages: rejected tokens leave every later stage
                weights, batch["response_mask"], corr_metrics = self._correction_fn(
                    batch["old_log_probs"], rollout_logprobs, sampled_mask)
                if weights is not None:
                    batch["rollout_is_weights"] = weights
                out_metrics.update({k: float(v) for k, v in corr_metrics.items()})
            if self.ref is not None:
                with timer("ref"):
                    batch["ref_log_probs"] = jax.block_until_ready(
                        self._forward_pass("ref", self.ref, batch, host))
            if self.critic is not None or self.shared_value:
                with timer("values"):
                    batch["values"] = jax.block_until_ready(
                        self._forward_pass("values", self._pass_role("values"), batch, host))
            self._abandon_if_stopping()  # the last point before the step changes state (KL controller, weights)
            with timer("adv"):
                group_ids = to_global(self.mesh, np.repeat(np.arange(len(pb)) + jax.process_index() * len(pb), n).astype(np.int32))
                token_scores = token_scores[:, :batch["response_mask"].shape[1]]
                rewards, adv, returns, current_kl = self._advantage_fn(
                    token_scores, batch["response_mask"], group_ids, batch.get("old_log_probs"), batch.get("ref_log_probs"),
                    batch.get("values"), self.kl_ctrl["value"], baselines)
                batch["advantages"], batch["returns"] = jax.block_until_ready((adv, returns))
                if cfg.algorithm.use_kl_in_reward:
                    out_metrics["actor/reward_kl_penalty"] = float(current_kl)
                    out_metrics["actor/reward_kl_penalty_coeff"] = float(self.kl_ctrl["value"])
                    self.kl_ctrl = algos.update_kl_controller(self.kl_ctrl, current_kl, d.rollout_batch_size)
            if self.critic is not None:
                with timer("update_critic"):
                    out_metrics.update(self._update_critic(batch, host))
                    jax.block_until_ready(self.critic.params)
            if self.step >= cfg.trainer.critic_warmup:
                with timer("update_actor"):
                    out_metrics.update(self._update_actor(batch, host))
                    jax.block_until_ready(self.actor.params)
        # Metrics cover every process's rows (gathered after the step's timer: they are not part of the step).
        arrays = {k: gather_all(v) for k, v in batch.items() if k in ("advantages", "returns", "values")}
        arrays["response_mask"] = gather_all(sampled_mask)  # lengths of what was sampled, before any rejection
        arrays.update(token_level_scores=gather_all(token_scores), token_level_rewards=gather_all(rewards),
                      prompt_mask=gather_all(out.prompt_mask))
        out_metrics.update(self._layout_metrics)
        out_metrics.update(M.data_metrics(arrays, max_prompt_length=cfg.data.max_prompt_length,
                                          max_response_length=cfg.actor_rollout_ref.rollout.response_length))
        resp_tokens = int(arrays["response_mask"].sum())
        total_tokens = resp_tokens + int(arrays["prompt_mask"].sum())
        seconds = {k[len("timing_s/"):]: v for k, v in experience.metrics.items() if k.startswith("timing_s/")}
        for k, v in timer.seconds.items():  # the production's stages plus this step's own
            seconds[k] = seconds.get(k, 0.0) + v
        out_metrics.update(M.timing_metrics(seconds, response_tokens=resp_tokens, total_tokens=total_tokens))
        out_metrics.update(M.perf_metrics(total_tokens=total_tokens, step_seconds=timer.seconds["step"],
                                          update_seconds=timer.seconds.get("update_actor", 0.0), num_params=self.num_params,
                                          ppo_epochs=cfg.actor_rollout_ref.actor.ppo_epochs,
                                          num_devices=d.num_devices + cfg.mesh.rollout_devices))
        out_metrics["actor/kl_coef"] = float(cfg.actor_rollout_ref.actor.kl_loss_coef)
        out_metrics["actor/lr"] = float(self.actor.lr_fn(self.step))
        if self.critic is not None:
            out_metrics["critic/lr"] = float(self.critic.lr_fn(self.step))
        out_metrics["training/global_step"] = self.step + 1
        out_metrics["training/epoch"] = pb.epoch
        return out_metrics

    def _abandon_if_stopping(self) -> None:
        if self.stop.agreed():
            raise StepAbandoned

    def _permutation(self, n: int, epoch: int, salt: int, shuffle: bool) -> np.ndarray:
        if not shuffle:
            return np.arange(n)
        return np.random.default_rng([int(self.cfg.trainer.seed), self.step, epoch, salt]).permutation(n)

    # ------------------------------------------------------------------ memory plan
    def _pass_role(self, name: str) -> Role | None:
        cfg, d = self.cfg, self.cfg.derived
        if name == "old_log_prob":
            return self.actor if (d.recompute_old_log_prob or cfg.algorithm.use_kl_in_reward) else None
        values = self.actor if self.shared_value else self.critic
        return {"ref": self.ref, "update_actor": self.actor, "values": values, "update_critic": self.critic}[name]

    def plan_memory(self) -> None:
        """Compile every training pass before the first step, size automatic (-1) micro-batches to the largest that
        XLA's memory estimate fits, and stop with the keys to change when a size the user set cannot fit."""
        if self._memory_planned:
            return
        free = free_device_memory()
        for name, plan in list(self.plans.items()):
            role = self._pass_role(name)
            if role is None:
                continue
            hint = memory_hint(self.cfg, "critic" if role is self.critic else "actor")
            held = held_bytes(role, name)
            plan, need = fit_pass(plan, lambda p: compile_pass(self, name, role, p), free, hint,
                                  lambda compiled: pass_bytes(compiled, held))
            self.plans[name] = plan
            estimate = f"~{gib(need)} per device" if need is not None else "no estimate on this backend"
            self.logger.text(f"memory plan: {name}: micro-batches of {describe(plan)} per shard, {estimate}"
                             + (f" ({gib(free)} free)" if free is not None else ""))
        self._memory_planned = True

    # ------------------------------------------------------------------ batch layout
    def _training_batch(self, out, host: dict) -> tuple[dict, jax.Array]:
        """The step's training batch and the sampler's log-probs, on the same (N, R') response grid.

        Packed passes keep the full response width R (their shapes do not depend on it); when no pass
        is packed, the all-padding prompt and response columns are cut (to power-of-two widths).
        """
        self._layout_metrics = {}
        if any(p.packed for p in self.plans.values()):
            width_p, width_r = out.prompts.shape[1], out.responses.shape[1]
        else:
            width_p, width_r = trim_columns(host["prompt_mask"], host["response_valid"])
        P = out.prompts.shape[1]
        responses, rmask = out.responses[:, :width_r], out.response_mask[:, :width_r]
        # The attention mask covers every token of the sequence; response_mask only the trained ones (multi-turn
        # rollouts leave holes at tool responses), which every loss, entropy, KL and token mean uses.
        batch = {"input_ids": jnp.concatenate([out.prompts[:, P - width_p:], responses], axis=1),
                 "attention_mask": jnp.concatenate([out.prompt_mask[:, P - width_p:], out.valid_mask()[:, :width_r]],
                                                   axis=1),
                 "responses": responses, "response_mask": rmask}
        real = int(host["prompt_mask"].sum() + host["response_valid"].sum())
        self._layout_metrics.update({"perf/real_tokens": float(real),
                                     "perf/padded_tokens_unpacked": float(host["responses"].shape[0] * (width_p + width_r))})
        return batch, out.logprobs[:, :width_r]

    def _micros(self, plan: PassPlan, host: dict, rows: np.ndarray | None = None) -> list[dict]:
        """Packed micro-batches of ``host`` (global numpy; ``rows`` selects and orders a mini-batch) on the mesh."""
        if rows is not None:
            host = {k: v[rows] for k, v in host.items()}
        dp = self.cfg.derived.dp_size
        packed = pack_batch(host["prompts"], host["prompt_mask"], host["responses"], host["response_valid"],
                            dp=dp, row_len=plan.row_len, max_rows_per_micro=plan.rows_per_micro,
                            pad_token_id=int(self.c.sampling.pad_token_id))
        for key, count in (("packed_tokens", packed.padded_tokens), ("placed_tokens", packed.placed_tokens)):
            name = f"perf/{key}/{plan.name}"  # cells computed; tokens laid in them (shared prompts once)
            self._layout_metrics[name] = self._layout_metrics.get(name, 0.0) + float(count)

        def local(x: np.ndarray) -> np.ndarray:  # this process's shards: a contiguous block of every array
            n = x.shape[0] // jax.process_count()
            return x[jax.process_index() * n:(jax.process_index() + 1) * n]

        return [{k: to_global(self.mesh, local(v)) for k, v in packed.micro(i).items()}
                for i in range(packed.num_micro)]

    def _forward_pass(self, name: str, role: Role, batch: dict, host: dict) -> jax.Array:
        """Old/ref log-probs or values (N, R') of the whole batch, packed or padded as the pass is planned."""
        plan = self.plans[name]
        if not plan.packed:
            if name == "values":
                return role.values(batch, n_micro=plan.num_micro)
            return role.log_probs(batch, n_micro=plan.num_micro, temperature=self.actor_spec.temperature)
        micros = self._micros(plan, host)
        grid_shape = tuple(batch["response_mask"].shape)
        dp = self.cfg.derived.dp_size
        if name == "values":
            return role.values_packed(micros, grid_shape, dp=dp)
        return role.log_probs_packed(micros, grid_shape, dp=dp, temperature=self.actor_spec.temperature)

    def _update_actor(self, batch: dict, host: dict) -> dict:
        cfg, d = self.cfg, self.cfg.derived
        keys = ["input_ids", "attention_mask", "responses", "response_mask", "old_log_probs", "advantages"]
        if self.actor_spec.use_kl_loss:
            keys.append("ref_log_probs")
        if "rollout_is_weights" in batch:
            keys.append("rollout_is_weights")
        if self.shared_value:
            keys += ["values", "returns"]
        plan = self.plans["update_actor"]
        sub = {k: batch[k] for k in keys if not plan.packed or k not in ("input_ids", "attention_mask", "responses")}
        collected: dict[str, list] = {}
        update_key = jax.random.fold_in(jax.random.key(int(cfg.trainer.seed)), self.step)
        a = cfg.actor_rollout_ref.actor
        num = d.actor_num_mini_batches
        for epoch in range(a.ppo_epochs):
            perm = self._permutation(d.rollout_batch_size, epoch, 0, a.shuffle)
            for i, mb in enumerate(mini_batches(self.mesh, sub, num, perm)):
                key = jax.random.fold_in(update_key, epoch * 1000 + i)
                if plan.packed:
                    metrics = self.actor.update_packed(self.actor_spec, self._micros(plan, host, perm[i::num]), mb,
                                                       dp=d.dp_size, rng=key)
                else:
                    metrics = self.actor.update_actor(self.actor_spec, mb, key, n_micro=plan.num_micro)
                for k, v in metrics.items():
                    collected.setdefault(k, []).append(v)
        return {k: float(np.mean([float(x) for x in v])) for k, v in collected.items()}

    def _update_critic(self, batch: dict, host: dict) -> dict:
        cfg, d = self.cfg, self.cfg.derived
        plan = self.plans["update_critic"]
        keys = ("input_ids", "attention_mask", "responses", "response_mask", "values", "returns")
        sub = {k: batch[k] for k in keys if not plan.packed or k not in ("input_ids", "attention_mask", "responses")}
        collected: dict[str, list] = {}
        num = d.critic_num_mini_batches
        for epoch in range(cfg.critic.ppo_epochs):
            perm = self._permutation(d.rollout_batch_size, epoch, 1, cfg.critic.shuffle)
            for i, mb in enumerate(mini_batches(self.mesh, sub, num, perm)):
                if plan.packed:
                    metrics = self.critic.update_packed(self.critic_spec, self._micros(plan, host, perm[i::num]), mb,
                                                        dp=d.dp_size)
                else:
                    metrics = self.critic.update_critic(self.critic_spec, mb, n_micro=plan.num_micro)
                for k, v in metrics.items():
                    collected.setdefault(k, []).append(v)
        return {k: float(np.mean([float(x) for x in v])) for k, v in collected.items()}

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        if self.c.val_dataset is None:
            return {}
        sampling = self.c.val_sampling
        loader = loader_from_config(self.cfg.data, self.tok, "val", dataset=self.c.val_dataset)
        by_source: dict[str, list[float]] = {}
        examples = []
        dump: dict[str, list] = {"inputs": [], "outputs": [], "gts": [], "scores": []}
        for pb in loader:
            if self.stop.agreed():  # a stop request abandons validation: partial scores would mislead
                return {}
            out, keep, text_mask = self._sample(pb, sampling, self._rollout_key(sampling.seed, 0), {})
            responses, rmask = to_local(out.responses)[:keep], to_local(text_mask)[:keep]
            scores, _, texts, _ = self._score(pb, responses, rmask, sampling.n)
            dump["inputs"] += [t for t in pb.prompt_text for _ in range(sampling.n)]
            dump["gts"] += [g for g in pb.ground_truth for _ in range(sampling.n)]
            dump["outputs"] += texts
            dump["scores"] += [float(x) for x in scores]
            for i, s in enumerate(scores):
                src = pb.data_source[i // sampling.n]
                by_source.setdefault(src, []).append(float(s))
                if len(examples) < self.cfg.trainer.log_val_generations:
                    examples.append({"prompt": pb.prompt_text[i // sampling.n], "response": texts[i], "score": float(s),
                                     "ground_truth": str(pb.ground_truth[i // sampling.n])})
        if self.cfg.trainer.validation_data_dir:
            dump_generations(os.path.expanduser(self.cfg.trainer.validation_data_dir), self.step, **dump)
        # Each process scored its own prompts: combine per-source sums and counts over processes.
        sources = sorted({e.data_source for e in self.c.val_dataset.examples})
        totals = np.zeros((len(sources), 3))
        for j, src in enumerate(sources):
            groups = np.asarray(by_source.get(src, []), np.float64).reshape(-1, sampling.n)
            totals[j] = (groups.mean(1).sum(), groups.max(1).sum() if groups.size else 0.0, groups.shape[0])
        totals = sum_over_processes(totals)
        metrics = {}
        for j, src in enumerate(sources):
            mean_sum, best_sum, count = totals[j]
            if count == 0:
                continue
            metrics[f"val-core/{src}/reward/mean@{sampling.n}"] = float(mean_sum / count)
            if sampling.n > 1:
                metrics[f"val-core/{src}/reward/best@{sampling.n}/mean"] = float(best_sum / count)
        if examples and self.is_main:
            for ex in examples:
                self.logger.text(f"[val] {json.dumps(ex, ensure_ascii=False)}")
            self.logger.val_generations(self.step, examples)
        return metrics

    # ------------------------------------------------------------------ the loop (FitLoop)
    def _next_step(self) -> dict[str, Any]:
        return self._train_next()  # the loader is rewound to what a resumed run must sample again

    def _close_resources(self) -> None:
        self._close_experience()
        self.reward_manager.close()


