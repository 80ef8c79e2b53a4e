"""Finalize a config: fill derived values, then reject settings that cannot work, before anything compiles.

:func:`finalize` is a pure function of the config, the device and process
counts and (optionally) the training-set size; it reads nothing but the
model's ``config.json`` and the existence of the files the config names. It
returns a locked copy in which every ``None`` that means "derived" is filled,
``${...}`` references are resolved, and a ``derived`` section holds the batch
arithmetic the trainer needs (documented in :data:`DERIVED_DOCS`).

Every error is a ValueError whose message names the key and the fix.
"""

from __future__ import annotations

import copy
import importlib
import logging
import math
import os
from typing import Any

from ml_collections import ConfigDict

from rlhf_jax.algos.rollout_correction import correction_from_config
from rlhf_jax.config import builtin, placement, schema
from rlhf_jax.config.consistency import check_consistency
from rlhf_jax.config.derive import derive_batches
from rlhf_jax.config.interpolation import has_reference, resolve
from rlhf_jax.config.names import GROUP_ESTIMATORS, check_name
from rlhf_jax.train import tasks

log = logging.getLogger("rlhf_jax.config")

MESH_AXES = ("data", "fsdp", "tensor", "expert")


def _resolve_references(cfg: ConfigDict) -> None:
    def lookup(path: str) -> Any:
        if path not in schema.DOCS:
            raise KeyError(path)
        return schema.get_path(cfg, path)

    for path, value in list(schema.iter_leaves(cfg)):
        if has_reference(value):
            schema.set_path(cfg, path, resolve(value, lookup, path))


def _check_choices(cfg: ConfigDict) -> None:
    for key in schema.KEYS:
        if key.choices is None:
            continue
        value = schema.get_path(cfg, key.path)
        if value is None:
            continue
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            if v not in key.choices:
                raise ValueError(f"{key.path}={v!r} is not valid; choose from {', '.join(map(str, key.choices))}")


def _fill_defaults(cfg: ConfigDict) -> None:
    """The ``None`` = "same as ..." keys."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    actor, rollout = arr.actor, arr.rollout
    if rollout.response_length is None:
        rollout.response_length = cfg.data.max_response_length
    if rollout.seed is None:
        rollout.seed = cfg.trainer.seed
    if rollout.dtype is None:
        rollout.dtype = arr.model.compute_dtype
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    if actor.loss_scale_factor is None:
        actor.loss_scale_factor = float(rollout.response_length)
    if critic.enable is None:
        critic.enable = cfg.algorithm.adv_estimator == "gae" and cfg.algorithm.type == "rl"  # other trainers have none
    if critic.model.path is None:
        critic.model.path = arr.model.path
        if critic.model.revision is None:
            critic.model.revision = arr.model.revision
    for name in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "shuffle", "loss_agg_mode"):
        if critic[name] is None:
            critic[name] = actor[name]
    if critic.forward_micro_batch_size_per_gpu is None:
        critic.forward_micro_batch_size_per_gpu = critic.ppo_micro_batch_size_per_gpu
    for role in (rollout, arr.ref):
        if role.log_prob_use_dynamic_bsz is None:
            role.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if role.log_prob_max_token_len_per_gpu is None:
            role.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    if critic.model.remat_policy is None:
        critic.model.remat_policy = arr.model.remat_policy
    if critic.model.use_remove_padding is None:
        critic.model.use_remove_padding = arr.model.use_remove_padding
    if critic.use_dynamic_bsz is None:
        critic.use_dynamic_bsz = actor.use_dynamic_bsz
    if critic.ppo_max_token_len_per_gpu is None:
        budget = actor.ppo_max_token_len_per_gpu
        critic.ppo_max_token_len_per_gpu = budget if budget == -1 else 2 * budget
    if critic.forward_max_token_len_per_gpu is None:
        critic.forward_max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
    for role in (actor, critic):
        if role.checkpoint.load_contents is None:
            role.checkpoint.load_contents = role.checkpoint.save_contents
    if cfg.trainer.remove_previous_ckpt_in_save:
        if cfg.trainer.max_actor_ckpt_to_keep not in (None, 1):
            raise ValueError(f"trainer.remove_previous_ckpt_in_save keeps one checkpoint but trainer.max_actor_ckpt_to_keep="
                             f"{cfg.trainer.max_actor_ckpt_to_keep}: set one of them")
        cfg.trainer.max_actor_ckpt_to_keep = 1
    if cfg.trainer.max_critic_ckpt_to_keep is None:
        cfg.trainer.max_critic_ckpt_to_keep = cfg.trainer.max_actor_ckpt_to_keep
    elif cfg.trainer.max_critic_ckpt_to_keep != cfg.trainer.max_actor_ckpt_to_keep:
        raise ValueError(
            f"trainer.max_critic_ckpt_to_keep={cfg.trainer.max_critic_ckpt_to_keep} differs from "
            f"trainer.max_actor_ckpt_to_keep={cfg.trainer.max_actor_ckpt_to_keep}: one checkpoint holds actor and "
            "critic, so leave max_critic_ckpt_to_keep unset"
        )
    if cfg.reward_model.max_length is None:
        cfg.reward_model.max_length = cfg.data.max_prompt_length + rollout.response_length


def _positive(cfg: ConfigDict, paths: tuple[str, ...], minimum: float = 1) -> None:
    for path in paths:
        value = schema.get_path(cfg, path)
        if value is None or value < minimum:
            raise ValueError(f"{path}={value!r} must be >= {minimum}")


def _micro_sizes(cfg: ConfigDict, paths: tuple[str, ...]) -> None:
    for path in paths:
        value = schema.get_path(cfg, path)
        if value is None or (value < 1 and value != -1):
            raise ValueError(f"{path}={value!r} must be >= 1, or -1 for the whole per-shard batch")


def _check_ranges(cfg: ConfigDict) -> None:
    a = "actor_rollout_ref."
    _micro_sizes(cfg, (a + "actor.ppo_micro_batch_size_per_gpu", a + "rollout.log_prob_micro_batch_size_per_gpu",
                       a + "ref.log_prob_micro_batch_size_per_gpu"))
    _positive(cfg, ("data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
                    a + "rollout.n", a + "rollout.response_length", a + "rollout.val_kwargs.n",
                    a + "actor.ppo_mini_batch_size", a + "actor.ppo_epochs",
                    "trainer.total_epochs", "reward_model.num_workers", "reward_model.micro_batch_size_per_gpu"))
    if cfg.data.val_batch_size is not None:
        _positive(cfg, ("data.val_batch_size",))
    if cfg.critic.enable:
        _positive(cfg, ("critic.ppo_mini_batch_size", "critic.ppo_epochs"))
        _micro_sizes(cfg, ("critic.ppo_micro_batch_size_per_gpu", "critic.forward_micro_batch_size_per_gpu"))
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    model = cfg.actor_rollout_ref.model
    if model.lora_rank < 0:
        raise ValueError(f"{a}model.lora_rank={model.lora_rank} must be >= 0 (0 = no LoRA)")
    if model.lora_rank and not model.lora_alpha > 0:
        raise ValueError(f"{a}model.lora_alpha={model.lora_alpha} must be > 0")
    if model.lora_adapter_path and not model.lora_rank:
        raise ValueError(f"{a}model.lora_adapter_path is set but {a}model.lora_rank=0: set lora_rank (and "
                         "lora_alpha, target_modules) to the adapter's")
    for path in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        if not getattr(actor, path) > 0:
            raise ValueError(f"{a}actor.{path}={getattr(actor, path)} must be > 0")
    if not actor.clip_ratio_c > 1:
        raise ValueError(f"{a}actor.clip_ratio_c={actor.clip_ratio_c} must be > 1 (dual-clip bound)")
    for prefix, sampling in (("rollout", rollout), ("rollout.val_kwargs", rollout.val_kwargs)):
        if sampling.do_sample and not sampling.temperature > 0:
            raise ValueError(f"{a}{prefix}.temperature={sampling.temperature} must be > 0 when "
                             f"{a}{prefix}.do_sample=True (set do_sample=False for greedy decoding)")
        if not 0 < sampling.top_p <= 1:
            raise ValueError(f"{a}{prefix}.top_p={sampling.top_p} must be in (0, 1]")
    if not rollout.temperature > 0:
        raise ValueError(f"{a}rollout.temperature={rollout.temperature} must be > 0 (it scales training log-probs)")
    for path in ("algorithm.gamma", "algorithm.lam"):
        if not 0 <= schema.get_path(cfg, path) <= 1:
            raise ValueError(f"{path}={schema.get_path(cfg, path)} must be in [0, 1]")
    for path in ("algorithm.kl_ctrl.kl_coef", a + "actor.kl_loss_coef", a + "actor.entropy_coeff",
                 a + "actor.router_aux_loss_coef"):
        if (schema.get_path(cfg, path) or 0) < 0:
            raise ValueError(f"{path}={schema.get_path(cfg, path)} must be >= 0")
    for role in (a + "actor", "critic"):  # a negative rate ascends the loss; NaN/inf wreck the weights
        optim = schema.get_path(cfg, role + ".optim")
        for name in ("lr", "weight_decay", "eps", "min_lr_ratio"):
            value = optim[name]
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{role}.optim.{name}={value} must be a finite number >= 0")
    if cfg.trainer.total_training_steps is not None and cfg.trainer.total_training_steps < 1:
        raise ValueError(f"trainer.total_training_steps={cfg.trainer.total_training_steps} must be >= 1 (or None)")
    buckets = cfg.data.prompt_length_buckets
    if buckets:
        if list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] > cfg.data.max_prompt_length:
            raise ValueError(f"data.prompt_length_buckets={buckets} must be strictly ascending positive lengths "
                             f"<= data.max_prompt_length ({cfg.data.max_prompt_length})")


def _check_token_budgets(cfg: ConfigDict) -> None:
    """Token-budget micro-batches need packing, and a budget must hold the longest possible sequence."""
    a = "actor_rollout_ref."
    longest = cfg.data.max_prompt_length + cfg.actor_rollout_ref.rollout.response_length
    roles = [(a + "actor.use_dynamic_bsz", (a + "actor.ppo_max_token_len_per_gpu",), a + "model.use_remove_padding"),
             (a + "rollout.log_prob_use_dynamic_bsz", (a + "rollout.log_prob_max_token_len_per_gpu",),
              a + "model.use_remove_padding"),
             (a + "ref.log_prob_use_dynamic_bsz", (a + "ref.log_prob_max_token_len_per_gpu",), a + "model.use_remove_padding")]
    if cfg.critic.enable:
        roles.append(("critic.use_dynamic_bsz", ("critic.ppo_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu"),
                      "critic.model.use_remove_padding"))
    for flag, budgets, packing in roles:
        if not schema.get_path(cfg, flag):
            continue
        if not schema.get_path(cfg, packing):
            raise ValueError(f"{flag}=True packs sequences by a token budget and needs {packing}=True")
        for path in budgets:
            value = schema.get_path(cfg, path)
            if value != -1 and value < longest:
                raise ValueError(f"{path}={value} cannot hold one sequence of data.max_prompt_length + "
                                 f"rollout.response_length = {longest} tokens: raise it to >= {longest}, or -1 "
                                 "for the largest budget that fits in memory")


def _check_algorithm(cfg: ConfigDict) -> None:
    a = "actor_rollout_ref.actor."
    actor, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    tasks.check_type(alg.type)
    check_name("adv_estimator", alg.adv_estimator, "algorithm.adv_estimator")
    check_name("policy_loss", actor.policy_loss.loss_mode, a + "policy_loss.loss_mode")
    check_name("kl", alg.kl_penalty, "algorithm.kl_penalty")
    check_name("kl", actor.kl_loss_type, a + "kl_loss_type")
    check_name("loss_agg_mode", actor.loss_agg_mode, a + "loss_agg_mode")
    check_name("loss_agg_mode", cfg.critic.loss_agg_mode, "critic.loss_agg_mode")
    for path, kind, used in (("algorithm.kl_penalty", alg.kl_penalty, alg.use_kl_in_reward),
                             (a + "kl_loss_type", actor.kl_loss_type, actor.use_kl_loss)):
        if used and kind == "full":  # verl does not implement it either
            raise ValueError(f"{path}=full (KL over the whole vocabulary) is not supported: it needs the reference's "
                             "distribution at every response position, not only its log-prob of the sampled token; "
                             "use low_var_kl (k3, unbiased and low-variance), kl (k1) or mse (k2)")
    n = cfg.actor_rollout_ref.rollout.n
    if alg.adv_estimator in GROUP_ESTIMATORS and n < 2:
        raise ValueError(f"algorithm.adv_estimator={alg.adv_estimator} compares the samples of one prompt: set "
                         f"actor_rollout_ref.rollout.n >= 2 (got {n})")
    if alg.adv_estimator == "gae" and not cfg.critic.enable and alg.type == "rl":
        raise ValueError("algorithm.adv_estimator=gae needs a value model but critic.enable=False: set "
                         "critic.enable=True (or None), or pick a critic-free estimator such as grpo")
    if cfg.trainer.critic_warmup > 0 and not cfg.critic.enable:
        raise ValueError(f"trainer.critic_warmup={cfg.trainer.critic_warmup} needs a critic: set critic.enable=True "
                         "or trainer.critic_warmup=0")
    ob = cfg.reward_model.overlong_buffer
    if ob.enable and not 0 < ob.len < cfg.actor_rollout_ref.rollout.response_length:
        raise ValueError(f"reward_model.overlong_buffer.len={ob.len} must be in (0, rollout.response_length="
                         f"{cfg.actor_rollout_ref.rollout.response_length})")
    correction_from_config(alg.rollout_correction, cfg.actor_rollout_ref.actor.tis_imp_ratio_cap)  # raises by key
    fg = alg.filter_groups
    if fg.enable and alg.adv_estimator == "remax":
        raise ValueError("algorithm.filter_groups with adv_estimator=remax is not supported: ReMax's greedy baseline "
                         "is drawn for one prompt batch; turn one of them off")
    if fg.enable and fg.metric == "seq_final_reward" and alg.use_kl_in_reward:
        raise ValueError("algorithm.filter_groups.metric=seq_final_reward with use_kl_in_reward: the KL penalty is "
                         "known only after the group filter; use score or acc")
    if cfg.reward_model.reward_manager == "batch" and not cfg.custom_reward_function.path:
        raise ValueError("reward_model.reward_manager=batch calls custom_reward_function once per batch: set "
                         "custom_reward_function.path to a function taking lists (data_sources, solution_strs, "
                         "ground_truths, extra_infos), or use naive")
    if cfg.reward_model.timeout_s <= 0:
        raise ValueError(f"reward_model.timeout_s={cfg.reward_model.timeout_s} must be > 0")
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path (a checkpoint step directory)")


# trainer.logger entries that are optional packages: name -> (module, pip command)
OPTIONAL_TRACKERS = {"wandb": ("wandb", "pip install wandb"), "mlflow": ("mlflow", "pip install mlflow")}


def _check_trackers_installed(backends: tuple) -> None:
    """A missing wandb / mlflow package stops the run here, before anything is built, with the pip command."""
    for name in backends:
        if name not in OPTIONAL_TRACKERS:
            continue
        module, pip = OPTIONAL_TRACKERS[name]
        try:
            importlib.import_module(module)
        except ImportError:
            raise ValueError(f"trainer.logger includes {name!r} but the {module} package is not installed: {pip} "
                             f"(or pip install 'rlhf_jax[{name}]'), or remove {name!r} from trainer.logger") from None


def resolve_mesh(data: int, fsdp: int, tensor: int, num_devices: int, expert: int = 1) -> tuple[int, int, int, int]:
    """(data, fsdp, tensor, expert) sizes with the one -1 (if any) filled so that they multiply to ``num_devices``."""
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor, "expert": expert}
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{name}={size} must be a positive size or -1 (the rest)")
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"only one mesh axis may be -1; got {', '.join('mesh.' + f for f in free)} = -1")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(f"mesh.{free[0]}=-1: {num_devices} devices are not divisible by the other axes' "
                             f"product {fixed}; change mesh.data/fsdp/tensor/expert")
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(f"mesh.data x mesh.fsdp x mesh.tensor x mesh.expert = {data} x {fsdp} x {tensor} x {expert} = "
                         f"{fixed}, but there are "
                         f"{num_devices} devices; make them multiply to {num_devices} or set one axis to -1")
    return sizes["data"], sizes["fsdp"], sizes["tensor"], sizes["expert"]


def _check_axis_rules(rules: tuple) -> None:
    seen = set()
    for rule in rules:
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"mesh.logical_axis_rules: each rule is (logical_name, mesh_axes), got {rule!r}")
        name, axes = rule
        if name in seen:
            raise ValueError(f"mesh.logical_axis_rules: logical axis {name!r} appears twice")
        seen.add(name)
        axes_t = () if axes is None else (axes,) if isinstance(axes, str) else axes
        for ax in axes_t:
            if ax not in MESH_AXES:
                raise ValueError(f"mesh.logical_axis_rules: {name!r} -> {ax!r} is not a mesh axis "
                                 f"({', '.join(MESH_AXES)})")


def _check_paths(cfg: ConfigDict) -> None:
    datasets = builtin.builtin_datasets()
    for which in ("train_files", "val_files"):
        files = cfg.data[which]
        if not files:
            raise ValueError(f"data.{which} is empty: give at least one file or builtin:<name>")
        for f in files:
            if builtin.is_builtin(f):
                if builtin.builtin_name(f) not in datasets:
                    raise ValueError(f"data.{which}: unknown builtin data set {f!r}; available: "
                                     f"{', '.join(builtin.PREFIX + d for d in datasets)}")
            elif not os.path.exists(os.path.expanduser(f)):
                raise ValueError(f"data.{which}: file {f!r} does not exist; fix the path or use builtin:arithmetic")
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
            if builtin.builtin_name(path) not in builtin.BUILTIN_MODELS:
                raise ValueError(f"{key}: unknown builtin model {path!r}; available: "
                                 + ", ".join("builtin:" + n for n in builtin.BUILTIN_MODELS))
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


def _check_model_limits(cfg: ConfigDict, derived: ConfigDict) -> None:
    hf = builtin.model_hf_config(cfg.actor_rollout_ref.model.path, cfg.actor_rollout_ref.model.revision) or {}
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    max_pos = hf.get("max_position_embeddings", text.get("max_position_embeddings"))
    derived.model_max_position_embeddings = int(max_pos) if max_pos else -1
    vocab = hf.get("vocab_size", text.get("vocab_size"))
    derived.model_vocab_size = int(vocab) if vocab else -1
    total = cfg.data.max_prompt_length + cfg.actor_rollout_ref.rollout.response_length
    if max_pos and total > max_pos:
        raise ValueError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + actor_rollout_ref.rollout.response_length "
            f"({cfg.actor_rollout_ref.rollout.response_length}) = {total} exceeds the model's "
            f"max_position_embeddings ({max_pos}); shorten them so they sum to at most {max_pos}")


def _check_multi_turn(cfg: ConfigDict, num_processes: int, check_paths: bool) -> None:
    """Multi-turn settings (tools by name, turn limits) and what multi-turn rollouts do not combine with yet."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return
    key = "actor_rollout_ref.rollout.multi_turn.enable=True"
    if cfg.algorithm.filter_groups.enable:
        raise ValueError(f"{key} with algorithm.filter_groups.enable is not supported: switch one off")
    if cfg.mesh.rollout_devices:
        raise ValueError(f"{key} with mesh.rollout_devices is not supported: multi-turn rollouts run on the "
                         "training mesh (set mesh.rollout_devices=0)")
    if num_processes > 1:
        raise ValueError(f"{key} runs in one process; this run has {num_processes}")
    if cfg.algorithm.adv_estimator == "remax":
        raise ValueError(f"{key} with algorithm.adv_estimator=remax is not supported (its greedy baseline is a "
                         "single-turn rollout)")
    from rlhf_jax.agents.settings import turn_settings

    if check_paths or not mt.tool_config_path:
        turn_settings(mt, cfg.actor_rollout_ref.rollout.response_length)


def finalize(
    cfg: ConfigDict,
    *,
    num_devices: int,
    num_processes: int = 1,
    train_dataset_size: int | None = None,
    check_paths: bool = True,
) -> ConfigDict:
    """A locked, validated copy of ``cfg`` with derived values filled and a ``derived`` section added.

    ``train_dataset_size`` (prompts, after filtering) lets the total step count
    be derived from ``trainer.total_epochs``; without it, only an explicit
    ``trainer.total_training_steps`` fixes it (``derived.total_training_steps``
    is -1 otherwise). ``check_paths=False`` skips file-existence checks (to
    check a recipe meant for another machine).
    """
    if num_devices < 1 or num_processes < 1 or num_devices % num_processes:
        raise ValueError(f"num_devices={num_devices} must be a positive multiple of num_processes={num_processes}")
    schema.check_known_keys(cfg)
    out = copy.deepcopy(cfg)
    out.unlock()
    if "derived" in out:
        del out["derived"]
    _resolve_references(out)
    _check_choices(out)
    _fill_defaults(out)
    _check_ranges(out)
    check_consistency(out)
    _check_algorithm(out)
    _check_token_budgets(out)
    _check_axis_rules(out.mesh.logical_axis_rules)
    _check_trackers_installed(out.trainer.logger)
    train_devices = placement.train_devices(out, placement.used_devices(out, num_devices, num_processes),
                                            num_processes)
    placement.check_experience(out)
    placement.check_shared_trunk(out)
    mesh = resolve_mesh(out.mesh.data, out.mesh.fsdp, out.mesh.tensor, train_devices, out.mesh.expert)
    if check_paths:
        _check_paths(out)
    if out.algorithm.filter_groups.enable and num_processes > 1:
        raise ValueError("algorithm.filter_groups runs in one process (it regroups the batch on the host); "
                         f"this run has {num_processes}")
    _check_multi_turn(out, num_processes, check_paths)
    derived = derive_batches(out, mesh=mesh, num_devices=train_devices, num_processes=num_processes,
                             train_dataset_size=train_dataset_size)
    _check_model_limits(out, derived)
    if out.actor_rollout_ref.actor.use_kl_loss and out.algorithm.use_kl_in_reward:
        log.warning("both actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward are on: the KL "
                    "to the reference is penalised twice")
    out.derived = derived
    out.lock()
    return out
