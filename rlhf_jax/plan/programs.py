"""Every program a run compiles, built by the run's own builders over abstract parameters on a target's devices.

The roles are ``train/engine.Role`` objects over abstract models (``abstract.py``), the passes are laid out by
``train/passes.plan_passes`` and compiled by ``train/passes.compile_pass``, the sampler is ``rollout/sampler.Sampler``
(prefill and every decode loop of the scheduler in one program), the LoRA merge is ``models/lora.merged_weights``:
what compiles here is what a run on the target compiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

from rlhf_jax.algos.rollout_correction import correction_from_config
from rlhf_jax.models import TASK_CAUSAL_LM, TASK_CAUSAL_LM_VALUE, TASK_TOKEN_VALUE, lora
from rlhf_jax.parallel import make_mesh
from rlhf_jax.plan.abstract import abstract_model, hf_config, model_config, relocated
from rlhf_jax.rollout import Sampler, SamplingParams
from rlhf_jax.train.engine import Role
from rlhf_jax.train.optim import make_optimizer
from rlhf_jax.train.setup import lora_spec, offload_flags, sampler_graphdef
from rlhf_jax.train import losses
from rlhf_jax.train.losses import Loss
from rlhf_jax.train.offload import place, to_device
from rlhf_jax.train.passes import PassPlan, StepPasses, compile_pass, pass_batch, step_correction, step_passes
from rlhf_jax.train.steps import CriticLossSpec
from rlhf_jax.train.trainer_rollout import merge_dtype

A = "actor_rollout_ref."


@dataclasses.dataclass
class RunParts:
    cfg: ConfigDict  # finalized for the target's device count
    hf: dict  # the actor's config.json
    mesh: Any
    rollout_mesh: Any  # None: sampling on the training mesh
    rules: tuple
    actor: Role
    ref: Role | None
    critic: Role | None
    shared_value: bool
    sampler: Sampler
    sampling: SamplingParams
    passes: StepPasses  # which passes the step runs (train/passes.step_passes, as the trainer decides)
    actor_loss: Loss
    critic_loss: Loss


def meshes(cfg: ConfigDict, devices: list) -> tuple[Any, Any, tuple]:
    """(training mesh, rollout mesh or None, rules) over ``devices``, as ``train/setup.mesh_and_rules`` and
    ``rollout_mesh`` lay them out over a run's devices."""
    if cfg.mesh.rollout_processes:  # the last processes' devices sample (parallel/groups.split)
        hosts = sorted({d.process_index for d in devices})
        sampling = set(hosts[len(hosts) - int(cfg.mesh.rollout_processes):])
        train = [d for d in devices if d.process_index not in sampling]
        roll = [d for d in devices if d.process_index in sampling]
    else:
        k = int(cfg.mesh.rollout_devices)
        train, roll = devices[:len(devices) - k], devices[len(devices) - k:] if k else []
    mesh = make_mesh(*cfg.derived.mesh_shape, devices=train)
    rollout = make_mesh(data=len(roll), fsdp=1, tensor=1, expert=1, devices=roll) if roll else None
    rules = tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
                  for name, axes in cfg.mesh.logical_axis_rules)
    return mesh, rollout, rules


def _trainable(cfg: ConfigDict, model: nnx.Module):
    """The actor's trained parameters as a filter (None: all), as ``train/setup.actor_trainable`` decides it."""
    from rlhf_jax.train import freeze

    if lora_spec(cfg) is not None:
        return lora.trained_filter
    spec = freeze.FreezeSpec.from_config(cfg.actor_rollout_ref.actor.freeze)
    if not spec.active:
        return None
    return freeze.check(spec, nnx.split(model)[1], model.config.num_hidden_layers)


def abstract_actor(cfg: ConfigDict, hf: dict, mesh, rules, task: str, updates_per_step: int) -> Role:
    """The trained policy over abstract parameters, as ``train/setup.actor_role`` builds it: its optimizer and
    schedule, the LoRA / freeze filter and the offload flags."""
    arr = cfg.actor_rollout_ref
    model = abstract_model(model_config(cfg, hf, "actor"), task, mesh, rules)
    steps = max(1, int(cfg.derived.total_training_steps))
    tx, lr_fn = make_optimizer(arr.actor.optim, arr.actor.grad_clip, steps, updates_per_step)
    return Role(model, mesh, tx, lr_fn, _trainable(cfg, model), **offload_flags(cfg, "actor"))


def abstract_reference(cfg: ConfigDict, hf: dict, actor: Role, mesh, rules) -> Role:
    """The frozen reference, as ``train/setup.reference_role`` builds it: under LoRA the base model over the actor's
    frozen arrays, else its own abstract copy."""
    if actor.config.lora:
        return Role(nnx.merge(lora.plain_graphdef(actor.config, TASK_CAUSAL_LM), actor.frozen), mesh)
    model = abstract_model(model_config(cfg, hf, "ref"), TASK_CAUSAL_LM, mesh, rules)
    return Role(model, mesh, offload=bool(cfg.actor_rollout_ref.ref.fsdp_config.param_offload))


def sampling_params(cfg: ConfigDict, hf: dict) -> SamplingParams:
    """The training rollout's settings; stop tokens from config.json (no tokenizer is read)."""
    eos = hf.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    pad = hf.get("pad_token_id")
    pad = int(pad) if pad is not None else (eos[0] if eos else 0)
    return SamplingParams.from_config(cfg.actor_rollout_ref.rollout, eos_token_ids=eos, pad_token_id=pad)


def build_run(cfg: ConfigDict, devices: list) -> RunParts:
    """Abstract roles, sampler and loss settings of the finalized ``cfg`` on ``devices``."""
    from rlhf_jax.train.trainer import actor_loss_spec

    d, arr = cfg.derived, cfg.actor_rollout_ref
    hf = hf_config(arr.model.path)
    mesh, rollout_mesh, rules = meshes(cfg, devices)
    steps = max(1, int(d.total_training_steps))
    shared = bool(cfg.critic.enable and cfg.critic.shared_trunk)
    actor = abstract_actor(cfg, hf, mesh, rules, TASK_CAUSAL_LM_VALUE if shared else TASK_CAUSAL_LM,
                           d.actor_updates_per_step)
    ref = abstract_reference(cfg, hf, actor, mesh, rules) if d.need_ref else None
    critic = None
    if cfg.critic.enable and not shared:
        critic_hf = hf_config(cfg.critic.model.path) if cfg.critic.model.path else hf
        ctx, clr = make_optimizer(cfg.critic.optim, cfg.critic.grad_clip, steps, d.critic_updates_per_step)
        critic = Role(abstract_model(model_config(cfg, critic_hf, "critic"), TASK_TOKEN_VALUE, mesh, rules), mesh,
                      ctx, clr, **offload_flags(cfg, "critic"))
    sampling = sampling_params(cfg, hf)
    critic_spec = CriticLossSpec(cfg.critic.cliprange_value, cfg.critic.loss_agg_mode, arr.actor.loss_scale_factor)
    actor_spec = actor_loss_spec(cfg, d.recompute_old_log_prob, sampling.logprob_temperature, actor.config)
    if shared:
        actor_spec = dataclasses.replace(actor_spec, value=critic_spec, vf_coef=float(cfg.critic.vf_coef))
    correction = step_correction(cfg, correction_from_config(cfg.algorithm.rollout_correction,
                                                             arr.actor.tis_imp_ratio_cap))
    sampler = Sampler(sampler_graphdef(cfg, actor.config, actor.task, None if actor.config.lora else actor.graphdef),
                      mesh=rollout_mesh or mesh, rules=rules, max_positions=actor.config.max_position_embeddings)
    passes = step_passes(cfg, correction, use_kl_loss=actor_spec.use_kl_loss)
    return RunParts(cfg, hf, mesh, rollout_mesh, rules, actor, ref, critic, shared, sampler, sampling, passes,
                    losses.actor(actor_spec), losses.critic(critic_spec))


def pass_role(run: RunParts, name: str) -> Role | None:
    """The role that runs the training pass ``name`` (None: the run skips it), as the trainer's ``StepPasses``
    decides."""
    if not run.passes.runs(name):
        return None
    values = run.actor if run.passes.values == "actor" else run.critic
    return {"old_log_prob": run.actor, "ref": run.ref, "values": values, "update_actor": run.actor,
            "update_critic": run.critic}[name]


def compile_training_pass(run: RunParts, name: str, role: Role, plan: PassPlan):
    """Pass ``name`` compiled at ``plan`` for the largest batch the config allows, as ``Trainer.compile_pass``."""
    loss = {"update_actor": run.actor_loss, "update_critic": run.critic_loss}.get(name)
    return compile_pass(name, role, plan, pass_batch(run.cfg, run.passes, name, plan.packed),
                        dp=run.cfg.derived.dp_size, temperature=run.actor_loss.spec.temperature, loss=loss,
                        sum_pi_squared=run.passes.sum_pi_squared, teacher_topk=run.passes.teacher_topk,
                        router_replay=run.passes.router_replay)


def device_state(role: Role) -> Any:
    """The role's abstract parameters where the sampler reads them: on the devices (an offloaded actor's are copied
    there before each rollout)."""
    return place(role.state(), to_device(role.state_shardings()))


def merge_program(run: RunParts):
    """Under LoRA: (the lowered merge of the adapters into the adapted weights before each rollout, the sampler's
    state with the merged weights, the merged weights alone); (None, None, None) without LoRA. The caller compiles
    the merge: a compiler may refuse it for want of memory (the base weights and their merged copy side by side)."""
    spec = run.actor.config.lora
    if spec is None:
        return None, None, None
    state = device_state(run.actor)
    shardings = {lora.path_key(p): v.get_value() for p, v in nnx.to_flat_state(to_device(run.actor.frozen_shardings))}
    if run.cfg.mesh.rollout_processes:  # the sampling processes merge the adapters they receive into their own
        # copy of the base weights (train/split_run.py)
        state = relocated(state, run.rollout_mesh)
        shardings = {k: NamedSharding(run.rollout_mesh, v.spec) for k, v in shardings.items()}
    arr = run.cfg.actor_rollout_ref.rollout
    merge = functools.partial(lora.merged_weights, spec=spec, dtype=merge_dtype(arr.weight_dtype, arr.dtype))
    shapes = jax.eval_shape(merge, state)
    fn = jax.jit(merge, out_shardings={k: shardings[k] for k in shapes})
    merged = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in shapes.items()}
    return fn.lower(state), lora.merged_state(state, spec, merged), merged


def sampler_weights(run: RunParts, merged_state: Any) -> Any:
    """The weights the sampler reads: the actor's (adapters merged under LoRA), on the rollout devices' copy when
    ``mesh.rollout_devices`` is set."""
    weights = merged_state if merged_state is not None else device_state(run.actor)
    dtype = run.cfg.actor_rollout_ref.rollout.weight_dtype
    if dtype is not None:  # the sampler's copy in rollout.weight_dtype (train/trainer_rollout.Rollouts.weights)
        weights = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
                               if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, weights)
    return relocated(weights, run.rollout_mesh) if run.rollout_mesh is not None else weights


def sampler_prompts(run: RunParts) -> int:
    """Prompts a rollout samples from: the step's batch, padded to the sampler mesh's data-parallel size."""
    dp = run.rollout_mesh.devices.size if run.rollout_mesh is not None else int(run.cfg.derived.dp_size)
    return -(-int(run.cfg.data.train_batch_size) // dp) * dp


def sampler_program(run: RunParts, weights: Any, prompts: int):
    """The compiled rollout (prefill and every decode loop) for ``prompts`` prompts of the longest length."""
    return run.sampler.compiled(weights, prompts, int(run.cfg.data.max_prompt_length), run.sampling)
