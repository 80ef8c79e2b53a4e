"""Rules about the run rather than the algorithm: processes, the files the config names, the experience schedule, the
shared trunk and the multi-turn loop. Same form as :mod:`rlhf_jax.config.rules` (each named, each one line naming the
key); they run after those.

What needs the registries of the multi-turn loop (tools, tool-call parsers, environments, workflows: names a user's
file may register) is checked by ``rlhf_jax.agents.settings.turn_settings`` when the run is prepared, before any
data or model is read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ml_collections import ConfigDict

from rlhf_jax.config import builtin, hub_data, schema
from rlhf_jax.config.names import BUILTIN_DATASETS, BUILTIN_MODELS
from rlhf_jax.config.rule import Context, rule

_MT = "actor_rollout_ref.rollout.multi_turn."
_MAPS = (Mapping, ConfigDict)


@rule("experience.buffer_size", "experience.overlap", "experience.max_staleness", "mesh.rollout_devices",
      "mesh.rollout_processes")
def experience_schedule(cfg: ConfigDict, ctx: Context) -> None:
    """The experience schedule (buffer, overlap) has devices to overlap on and stays within the staleness bound."""
    e = cfg.experience
    if e.overlap and cfg.mesh.rollout_devices == 0 and not cfg.mesh.rollout_processes:
        raise ValueError("experience.overlap=True samples while the training devices update, so the rollout needs "
                         "devices of its own: set mesh.rollout_devices (e.g. half of the devices)")
    lag = 2 * e.buffer_size - 1 if e.overlap else e.buffer_size - 1
    if e.max_staleness is not None and lag > e.max_staleness:
        raise ValueError(f"experience.max_staleness={e.max_staleness}: experience.buffer_size={e.buffer_size} with "
                         f"experience.overlap={e.overlap} trains batches up to {lag} updates after their weights")


@rule("experience.partial_rollout_tokens", "experience.partial_rollout_wait", "mesh.rollout_processes",
      "experience.overlap", "experience.buffer_size", _MT + "enable")
def partial_rollouts(cfg: ConfigDict, ctx: Context) -> None:
    """Partial rollouts swap weights into a batch being sampled: a split run's sampling processes do that, in
    single-turn rollouts, for the one batch sampled while each update trains."""
    e = cfg.experience
    if e.partial_rollout_wait and not e.partial_rollout_tokens:
        raise ValueError("experience.partial_rollout_wait=True waits at a segment boundary: set "
                         "experience.partial_rollout_tokens (the segment length)")
    if e.partial_rollout_tokens and not cfg.mesh.rollout_processes:
        raise ValueError(f"experience.partial_rollout_tokens={e.partial_rollout_tokens} takes updates into the "
                         "batch being sampled, which needs sampling processes of their own: set "
                         "mesh.rollout_processes (or experience.partial_rollout_tokens=0)")
    if e.partial_rollout_tokens and not (e.overlap and e.buffer_size == 1):
        raise ValueError(f"experience.partial_rollout_tokens={e.partial_rollout_tokens} hands each update to the batch "
                         "sampled while it trains: set experience.overlap=True and experience.buffer_size=1")
    if e.partial_rollout_tokens and cfg.actor_rollout_ref.rollout.multi_turn.enable:
        raise ValueError(f"experience.partial_rollout_tokens={e.partial_rollout_tokens} with {_MT}enable is not "
                         "supported: a conversation's turns take the weights it started with (set "
                         "experience.partial_rollout_tokens=0)")


# Critic settings a shared trunk does not use: the actor's model, optimizer and mini-batches train the value head.
SEPARATE_CRITIC_ONLY = ("critic.optim.lr", "critic.optim.weight_decay", "critic.optim.optimizer", "critic.grad_clip",
                        "critic.model.enable_gradient_checkpointing", "trainer.critic_warmup",
                        "critic.model.fsdp_config.param_offload", "critic.model.fsdp_config.optimizer_offload")


@rule("critic.shared_trunk", "critic.enable", "critic.model.path", "actor_rollout_ref.model.path",
      *SEPARATE_CRITIC_ONLY)
def shared_trunk(cfg: ConfigDict, ctx: Context) -> None:
    """critic.shared_trunk: a value head on the actor; the settings of a separate critic stay unset."""
    c = cfg.critic
    if not c.shared_trunk:
        return
    if not c.enable:
        raise ValueError("critic.shared_trunk=True puts a value head on the actor, but no value model is trained "
                         f"(critic.enable=False, algorithm.adv_estimator={cfg.algorithm.adv_estimator}): use gae")
    if c.model.path != cfg.actor_rollout_ref.model.path:
        raise ValueError(f"critic.model.path={c.model.path!r}: with critic.shared_trunk the value head sits on the "
                         "actor's trunk; leave critic.model.path unset")
    for path in SEPARATE_CRITIC_ONLY:
        value = schema.get_path(cfg, path)
        if value != schema.get_key(path).default:
            raise ValueError(f"{path}={value!r} applies to a separate critic; with critic.shared_trunk the actor's "
                             "optimizer, mini-batches, remat and offload train the value head (set the actor's keys)")


@rule("data.train_files", "data.val_files", "algorithm.type", "actor_rollout_ref.model.path", "critic.model.path",
      "critic.enable", "reward_model.enable", "reward_model.model.path", "custom_reward_function.path")
def files_exist(cfg: ConfigDict, ctx: Context) -> None:
    """The data files, model directories and reward function the config names exist (skipped by check_paths=False)."""
    if not ctx.check_paths:
        return
    for which in ("train_files", "val_files"):
        files = cfg.data[which]
        if not files and which == "val_files" and cfg.algorithm.type in ("sft", "dpo"):
            continue  # the SFT and DPO trainers run without validation data
        if not files:
            raise ValueError(f"data.{which} is empty: give at least one file or builtin:<name>")
        for f in files:
            if builtin.is_builtin(f):
                if builtin.builtin_name(f) not in BUILTIN_DATASETS:
                    raise ValueError(f"data.{which}: unknown builtin data set {f!r}; available: "
                                     f"{', '.join(builtin.PREFIX + d for d in sorted(BUILTIN_DATASETS))}")
            elif hub_data.is_hub_dataset(f):
                try:
                    hub_data.parse(f)
                except ValueError as e:
                    raise ValueError(f"data.{which}: {e}") from None
            elif not os.path.exists(os.path.expanduser(f)):
                raise ValueError(f"data.{which}: file {f!r} does not exist; fix the path, name a Hub dataset "
                                 "(hf:<org>/<name>) or use builtin:arithmetic")
    # (key, path, whether the run reads a tokenizer from it): the policy's tokenizer comes from data.tokenizer if set
    models = [("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path, not cfg.data.tokenizer)]
    if cfg.critic.enable:
        models.append(("critic.model.path", cfg.critic.model.path, False))
    if cfg.reward_model.enable:
        if not cfg.reward_model.model.path:
            raise ValueError("reward_model.enable=True needs reward_model.model.path (a reward-model directory)")
        models.append(("reward_model.model.path", cfg.reward_model.model.path, True))
    for key, path, reads_tokenizer in models:
        if builtin.is_builtin(path):
            if builtin.builtin_name(path) not in BUILTIN_MODELS:
                raise ValueError(f"{key}: unknown builtin model {path!r}; available: "
                                 + ", ".join(builtin.PREFIX + n for n in BUILTIN_MODELS))
        elif builtin.looks_local(path) and not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
            raise ValueError(f"{key}: {path!r} is not a Hugging Face model directory (no config.json)")
        elif builtin.looks_local(path):
            builtin.check_model_files(key, path, tokenizer=reads_tokenizer, weights=True)
    tokenizer = cfg.data.tokenizer
    if tokenizer and not builtin.is_builtin(tokenizer) and builtin.looks_local(tokenizer):
        if not os.path.isdir(os.path.expanduser(tokenizer)):
            raise ValueError(f"data.tokenizer: directory {tokenizer!r} does not exist")
        builtin.check_model_files("data.tokenizer", tokenizer, tokenizer=True, weights=False)
    custom = cfg.custom_reward_function.path
    if custom and not os.path.isfile(os.path.expanduser(custom)):
        raise ValueError(f"custom_reward_function.path: file {custom!r} does not exist")


@rule("actor_rollout_ref.actor.router_replay.mode", "algorithm.rollout_correction.bypass_mode", "distillation.enabled")
def router_replay_combinations(cfg: ConfigDict, ctx: Context) -> None:
    """Routing replay: R2 records in the old-log-prob pass (no bypass), R3 in the sampler (single-turn, or the
    conversations of tool calls, environments and workflows), not with a teacher in the reference's pass."""
    mode = cfg.actor_rollout_ref.actor.router_replay.mode
    if mode == "disabled":
        return
    key = f"actor_rollout_ref.actor.router_replay.mode={mode}"
    if mode == "R2" and cfg.algorithm.rollout_correction.bypass_mode:
        raise ValueError(f"{key} with algorithm.rollout_correction.bypass_mode is not supported (R2 records routes "
                         "in the old-log-prob pass, which bypass mode skips): use mode=R3")
    if mode != "R3":
        return
    if cfg.distillation.enabled:  # R3 replays in the reference's pass, where the teacher (another model) sits
        raise ValueError(f"{key} with distillation.enabled is not supported (the teacher would replay the student's "
                         "routes): use mode=R2")


@rule(_MT + "enable", _MT + "tools", _MT + "tool_config_path", _MT + "environment", _MT + "workflow",
      _MT + "per_turn_rewards", _MT + "workflow_args", _MT + "environments", _MT + "interaction_config_path")
def multi_turn_driver(cfg: ConfigDict, ctx: Context) -> None:
    """A trajectory is driven by tools (and interactions), one environment or one workflow, and their options need
    their driver."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    k = _MT.rstrip(".")
    if not mt.enable:
        if mt.interaction_config_path:
            raise ValueError(f"{k}.interaction_config_path is set but {k}.enable is False: interactions answer "
                             "the turns of multi-turn rollouts")
        return
    drivers = [name for name, on in (("environment(s)", mt.environment or mt.environments),
                                     ("workflow", mt.workflow), ("interaction_config_path", mt.interaction_config_path))
               if on]
    if len(drivers) > 1:
        raise ValueError(f"{k}.{drivers[0]} and {k}.{drivers[1]} are both set: a trajectory is driven by one of them")
    if mt.environments is not None and not (isinstance(mt.environments, _MAPS) and mt.environments and all(
            isinstance(v, _MAPS) and v.get("environment") for v in mt.environments.values())):
        raise ValueError(f"{k}.environments must map names to entries with an 'environment' (a registered name or "
                         "path.py:Class)")
    if not (drivers or mt.tools or mt.tool_config_path):
        raise ValueError(f"{k}.enable=True needs tools: set {k}.tools (e.g. ['calculator']) or {k}.tool_config_path, "
                         f"or an environment ({k}.environment), a workflow ({k}.workflow) or interactions "
                         f"({k}.interaction_config_path)")
    if mt.per_turn_rewards and not (mt.environment or mt.environments):
        raise ValueError(f"{k}.per_turn_rewards=True needs an environment ({k}.environment): tool calls and "
                         "workflows give one reward per trajectory")
    if mt.workflow_args and not mt.workflow:
        raise ValueError(f"{k}.workflow_args is set but {k}.workflow is not: the arguments are a workflow's")


@rule("actor_rollout_ref.rollout.over_sample_rate", _MT + "enable")
def over_sampling(cfg: ConfigDict, ctx: Context) -> None:
    """Over-sampling cuts off the last trajectories of a multi-turn rollout (as verl's SGLang rollout did)."""
    rate = cfg.actor_rollout_ref.rollout.over_sample_rate
    if rate and not cfg.actor_rollout_ref.rollout.multi_turn.enable:
        raise ValueError(f"actor_rollout_ref.rollout.over_sample_rate={rate} aborts the last trajectories of "
                         f"multi-turn rollouts; set {_MT}enable=True or leave it 0")


@rule("mesh.rollout_processes", _MT + "enable", "algorithm.type")
def split_run_combinations(cfg: ConfigDict, ctx: Context) -> None:
    """What a run with sampling processes of their own does not do yet (each refused by name)."""
    k = cfg.mesh.rollout_processes
    if not k:
        return
    if cfg.algorithm.type != "rl":
        raise ValueError(f"mesh.rollout_processes={k} splits an RL run's sampling from its training; "
                         f"algorithm.type={cfg.algorithm.type} samples nothing (set mesh.rollout_processes=0)")
