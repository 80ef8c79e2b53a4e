"""Why a key of another trainer's file is refused: the capability rlhf_jax lacks, and how that is checked.

A foreign key is refused (by name, before anything is built) only when its value asks for something rlhf_jax cannot
do. Each refusal of a dialect's rule table (``config/dialects/*.py``, verl's :data:`verl_compat.IGNORED`) names one
:class:`Limit` in :data:`REFUSED_BECAUSE`. A limit lists the schema keys that would offer the capability
(``absent``); ``tests/config/test_refusals.py`` checks that the schema has none of them, so a feature built later
turns every refusal that still claims it is missing into a failing test, and that every refusal names a limit.
docs/CONFIG.md lists the refusals with their limits (``python -m rlhf_jax.config docs``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Limit:
    """What rlhf_jax does not do (``what``), and the schema key patterns (``absent``) that would do it."""

    what: str
    absent: tuple[str, ...]


LIMITS: dict[str, Limit] = {
    "host_offload": Limit("keeping the reward model's parameters in host memory (the actor's, critic's and "
                          "reference's can be: *.fsdp_config.param_offload / optimizer_offload)",
                          ("reward_model.*offload*",)),
    "host_optimizer_step": Limit("running the optimizer step on the host with parameters and gradients there (FSDP's "
                                 "CPU offload: verl's offload_policy, its SFT trainer's cpu_offload); offloaded "
                                 "optimizer state is updated on the devices", ("*offload_policy*", "*cpu_offload*")),
    "activation_offload": Limit("moving activations to host memory (remat saves activation memory instead)",
                                ("*activation_offload*",)),
    "sequence_parallel": Limit("splitting one sequence over several devices in the reward model's pass (the "
                               "training passes split it over mesh.context)",
                               ("reward_model.*ulysses*", "reward_model.*context*")),
    "sampler_mesh": Limit("a separate data, expert or pipeline layout for the sampler (it uses the training mesh)",
                          ("actor_rollout_ref.rollout.*_parallel_size", "mesh.pipeline")),
    "role_mesh": Limit("a different FSDP group size per role (every role is sharded by the mesh section)",
                       ("*.fsdp_config.fsdp_size",)),
    "role_dtypes": Limit("a parameter or compute dtype for one role other than the actor's (every role computes in "
                         "actor_rollout_ref.model.compute_dtype)",
                         ("critic.model.dtype", "critic.model.compute_dtype", "reward_model.model.*dtype",
                          "actor_rollout_ref.ref.*dtype")),
    "determinism_flag": Limit("a per-role switch for deterministic kernels (XLA_FLAGS decide it for the process)",
                              ("*determinism*",)),
    "role_profiling": Limit("profiling one role on its own (trainer.profile_steps traces whole steps)",
                            ("actor_rollout_ref.*.profiler*", "critic.profiler*", "reward_model.profiler*")),
    "external_model_code": Limit("running model or tokenizer code from outside rlhf_jax (remote code, external "
                                 "libraries, model classes from files)",
                                 ("*external_lib*", "*trust_remote_code*", "*model_cls*")),
    "config_overrides": Limit("changing a checkpoint's architecture settings (dropout, RoPE) from the run's config",
                              ("*override_config*", "*dropout*", "*rope_scaling*", "*rope_theta*")),
    "global_micro_batch": Limit("verl's deprecated global micro-batch sizes (micro-batches are sized per device)",
                                ("*.ppo_micro_batch_size", "*.log_prob_micro_batch_size", "*.micro_batch_size",
                                 "critic.forward_micro_batch_size")),
    "critic_lora": Limit("LoRA adapters on the critic (LoRA trains the actor)", ("critic.model.lora_*",)),
    "lora_exclude": Limit("excluding modules from LoRA by name (target_modules lists those adapted)",
                          ("*exclude_modules*",)),
    "repeat_rollouts": Limit("repeating a whole multi-turn rollout (rollout.n samples each prompt)",
                             ("*num_repeat_rollouts*",)),
    "agent_loops": Limit("verl's agent-loop classes and custom inference servers (multi-turn rollouts run "
                         "environments, workflows and tools)", ("*agent_loop*", "*custom_async_server*")),
    "data_code": Limit("dataset, sampler or data-generation classes loaded from user code",
                       ("data.custom_cls*", "data.sampler*", "data.datagen*")),
    "async_reward_fn": Limit("scoring in a background task overlapping the next step", ("*launch_reward_fn_async*",)),
    "sandbox": Limit("sandboxed code execution for rewards", ("*sandbox*",)),
    "pf_ppo": Limit("prioritized-replay PPO", ("*pf_ppo*",)),
    "delete_after_load": Limit("deleting local checkpoints after loading them", ("*del_local_ckpt*",)),
    "tiled_mlp": Limit("tiled MLP computation (remat saves the memory instead)", ("*tiled_mlp*",)),
    "routing_files": Limit("writing or reading mixture-of-experts routing decisions in files (router_replay.mode "
                           "keeps them in the step's arrays)", ("*router_replay.record_file", "*router_replay.replay_file")),
    "multimodal": Limit("vision or other multi-modal models", ("*vision_tower*", "*multi_modal*", "*pixel*")),
    "hf_config_path": Limit("a model config from another path than the checkpoint's", ("*hf_config_path*",)),
    "mtp": Limit("multi-token prediction heads", ("*mtp*",)),
    "over_sampling": Limit("Trinity's over-rollout (an explorer step that waits for only part of its tasks; "
                           "verl's rollout.over_sample_rate is honoured for multi-turn rollouts)", ("*over_rollout*",)),
    "rollout_trace": Limit("tracing rollouts to an external backend", ("*rollout.trace*",)),
    "rollout_replay": Limit("dumping rollouts and replaying them instead of sampling", ("*skip_rollout*",)),
    "server_metrics": Limit("an inference server's metrics endpoint", ("*prometheus*",)),
    "quantized_sampling": Limit("sampling with quantized weights", ("*quantization*",)),
    "reward_fn_key": Limit("choosing the scorer by another column than data_source", ("data.reward_fn_key",)),
    "reward_plugins": Limit("reward managers or reward loops loaded from user modules (custom_reward_function loads "
                            "a scoring function)", ("reward_manager.*", "reward_model.reward_loop*")),
    "reward_pool": Limit("a separate device pool for the reward model", ("reward_model.enable_resource_pool",
                                                                         "reward_model.n_gpus_per_node")),
    "generative_rm": Limit("generative (sampling) reward models", ("reward_model.rollout*",)),
    "balance_tokens": Limit("balancing tokens across data-parallel ranks", ("*balance_dp_token*",)),
    "optimizer_classes": Limit("optimizers from other libraries' classes (optimizers are optax's, by name)",
                               ("*optimizer_impl*",)),
    "schedule_length": Limit("a learning-rate schedule longer or shorter than the run", ("*.optim.total_training_steps",)),
    "hdfs": Limit("copying checkpoints to HDFS", ("*hdfs*",)),
    "experience_sampling": Limit("drawing experiences from a buffer in another order than sampled (priorities, "
                                 "mixtures)", ("*sample_strategy*", "experience.priorit*")),
    "repetition_penalty": Limit("a repetition penalty while sampling", ("*repetition_penalty*",)),
    "remote_training": Limit("training through a remote service (Tinker)", ("*tinker*",)),
    "external_models": Limit("external model APIs as the policy or as auxiliary models of a workflow",
                             ("*external_model*", "*auxiliary_model*")),
    "ray_tooling": Limit("Ray actors and their tooling (timelines, namespaces)", ("*ray_*", "*.ray")),
    "sampling_args": Limit("per-taskset sampling settings other than temperature, top_p and top_k",
                           ("*presence_penalty*", "*frequency_penalty*")),
    "data_services": Limit("tasks or experiences from queues, SQL stores or data services (data are files or Hub "
                           "datasets)", ("*storage_type*", "data.*sql*", "data.*queue*", "*data_juicer*")),
    "sft_mixing": Limit("mixing an SFT loss on another dataset into the RL updates", ("*auxiliary_buffer*",
                                                                                       "*sft_loss*")),
    "runner_timeouts": Limit("timing out slow rollout runners (a batch is decoded by one program)",
                             ("*dynamic_timeout*", "actor_rollout_ref.rollout.timeout*")),
    "sync_styles": Limit("weight synchronisation driven by progress rather than a fixed schedule",
                         ("experience.sync_style*",)),
    "trainer_backends": Limit("another trainer back end", ("*trainer_type*",)),
    "data_pipelines": Limit("task or experience processing pipelines (Data-Juicer operators)",
                            ("*pipeline*", "*operators*")),
    "frozen_roles": Limit("training the reference or the reward model (they stay fixed)",
                          ("actor_rollout_ref.ref.optim*", "reward_model.optim*")),
    "loading_args": Limit("model loading arguments other than the dtype (checkpoints load as saved)",
                          ("*model_kwargs*", "*load_args*", "*model_params*")),
    "strategy_code": Limit("other frameworks' optimization strategies (sharding comes from the mesh section)",
                           ("*strategy_file*", "*train_strategy*", "*inference_strategy*")),
    "shared_reference": Limit("one model as both the trained policy and the fixed reference or reward model",
                              ("*ref_shares*", "reward_model.shared_trunk")),
    "tokenizer_args": Limit("tokenizer loading arguments other than truncation and padding sides",
                            ("*tokenizer_kwargs*", "*tokenizer_args*")),
    "min_total_length": Limit("a minimum length counting the prompt (rollout.min_new_tokens counts the response)",
                              ("*min_length*",)),
    "kl_early_stop": Limit("stopping an update's epochs early when the KL exceeds a target", ("*early_stop*",)),
    "reward_scaling": Limit("scaling or normalising scores by running statistics across steps (algorithm.reward_norm "
                            "uses the batch's or the group's)", ("*score_scaling*", "*score_norm*", "*running_*")),
    "score_clip_only": Limit("clipping the scores alone (algorithm.reward_clip also clips the token rewards after the "
                             "in-reward KL, as ROLL does)", ("*score_clip*",)),
    "reward_whitening": Limit("whitening the rewards before the advantages", ("*whiten_rewards*",)),
    "checkpoint_backends": Limit("checkpoint storage other than files in a directory", ("*checkpoint*.type",
                                                                                       "*checkpoint_backend*")),
    "profiler_kinds": Limit("ROLL's timeline and memory profilers (trainer.profile_steps records jax.profiler traces)",
                            ("*profiler_timeline*", "*profiler_memory*")),
    "partial_staleness": Limit("mixing fresh and one-step-stale samples in one batch, or fractional staleness ratios "
                               "(experience.overlap trains each batch exactly one update behind)",
                               ("*async_generation_ratio*", "experience.staleness_ratio*")),
    "validation_lengths": Limit("validation prompt and response lengths other than the training ones",
                                ("*val_prompt_length*", "*val_sequence_length*", "*val_response_length*")),
    "l2_loss": Limit("an L2 penalty on the parameters in the loss (weight decay is the optimizer's)",
                     ("*.l2", "*l2_coef*")),
    "reward_shaping": Limit("ROLL's length rewards, TOPR, loss weights by difficulty or length, length balancing "
                            "and its mask of short wrong answers (error_max_len_clip)",
                            ("*add_len_reward*", "*difficulty_loss*", "*length_loss*", "*postive_loss*", "*topr*",
                             "*balance_length*", "*error_max_len*")),
    "policy_loss_types": Limit("ROLL's other policy loss types and loss weights", ("*use_policy_loss_type*",
                                                                                   "*rl_loss_coef*")),
    "sequence_ratios": Limit("sequence-level importance ratios inside token-level losses (loss_mode=gspo is one)",
                             ("*importance_sampling*",)),
    "lora_dropout": Limit("dropout on LoRA adapters", ("*lora_dropout*",)),
    "training_arguments": Limit("Hugging Face TrainingArguments beyond the optimizer and batch sizes",
                                ("*training_args*",)),
    "worker_classes": Limit("ROLL's worker classes other than its own (roll.*)", ("*worker_cls*",)),
    "model_types": Limit("a model architecture other than the checkpoint's config.json names", ("*model_type*",)),
    "beam_search": Limit("beam search (sampling draws one sequence per sample)", ("*num_beams*",)),
    "their_values": Limit("a value the other trainer does not define either", ()),
}

# format -> {their key (the rule's pattern) -> the limit that refuses it}
REFUSED_BECAUSE: dict[str, dict[str, str]] = {
    "verl": {
        "*.profiler": "role_profiling",
        "*.fsdp_config.fsdp_size": "role_mesh",
        "*.fsdp_config.model_dtype": "role_dtypes",
        "*.fsdp_config.dtype": "role_dtypes",
        "*.fsdp_config.mixed_precision": "role_dtypes",
        "reward_model.*fsdp_config.param_offload": "host_offload",
        "*.fsdp_config.offload_policy": "host_optimizer_step",
        "*.fsdp_config.full_determinism": "determinism_flag",
        "reward_model.ulysses_sequence_parallel_size": "sequence_parallel",
        "critic.*ulysses_sequence_parallel_size": "their_values",
        "actor_rollout_ref.ref.*ulysses_sequence_parallel_size": "their_values",
        "*.enable_activation_offload": "activation_offload",
        "*.external_lib": "external_model_code",
        "*.override_config": "config_overrides",
        "critic.model.lora_rank": "critic_lora",
        "*.exclude_modules": "lora_exclude",
        "*.ppo_micro_batch_size": "global_micro_batch",
        "*.log_prob_micro_batch_size": "global_micro_batch",
        "*.micro_batch_size": "global_micro_batch",
        "critic.forward_micro_batch_size": "global_micro_batch",
        "actor_rollout_ref.rollout.mode": "their_values",
        "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts": "repeat_rollouts",
        "actor_rollout_ref.rollout.agent": "agent_loops",
        "data.custom_cls": "data_code",
        "data.sampler": "data_code",
        "data.datagen": "data_code",
        "reward_model.launch_reward_fn_async": "async_reward_fn",
        "reward_model.sandbox_fusion": "sandbox",
        "algorithm.use_pf_ppo": "pf_ppo",
        "trainer.del_local_ckpt_after_load": "delete_after_load",
        "*.tiled_mlp": "tiled_mlp",
        "*.router_replay.record_file": "routing_files",
        "*.router_replay.replay_file": "routing_files",
        "actor_rollout_ref.actor.freeze_vision_tower": "multimodal",
        "actor_rollout_ref.model.hf_config_path": "hf_config_path",
        "actor_rollout_ref.model.mtp": "mtp",
        "actor_rollout_ref.rollout.mtp": "mtp",
        "actor_rollout_ref.rollout.data_parallel_size": "sampler_mesh",
        "actor_rollout_ref.rollout.expert_parallel_size": "sampler_mesh",
        "actor_rollout_ref.rollout.pipeline_model_parallel_size": "sampler_mesh",
        "actor_rollout_ref.rollout.trace": "rollout_trace",
        "actor_rollout_ref.rollout.skip_rollout": "rollout_replay",
        "actor_rollout_ref.rollout.prometheus": "server_metrics",
        "actor_rollout_ref.rollout.quantization": "quantized_sampling",
        "actor_rollout_ref.rollout.quantization_config_file": "quantized_sampling",
        "data.reward_fn_key": "reward_fn_key",
        "reward_manager.source": "reward_plugins",
        "reward_manager.module": "reward_plugins",
        "reward_model.enable_resource_pool": "reward_pool",
        "reward_model.reward_loop_source": "reward_plugins",
        "reward_model.reward_loop_module_path": "reward_plugins",
        "reward_model.reward_loop_class_name": "reward_plugins",
        "reward_model.rollout": "generative_rm",
    },
    "verl_sft": {
        "data.micro_batch_size": "global_micro_batch",
        "data.balance_dp_token": "balance_tokens",
        "data.custom_cls.*": "data_code",
        "model.external_lib": "external_model_code",
        "optim.optimizer_impl": "optimizer_classes",
        "optim.total_training_steps": "schedule_length",
        "trainer.default_hdfs_dir": "hdfs",
    },
    "roll": {
        "checkpoint_config.type": "checkpoint_backends",
        "profiler_timeline": "profiler_kinds",
        "profiler_memory": "profiler_kinds",
        "async_generation_ratio": "partial_staleness",
        "val_prompt_length": "validation_lengths",
        "val_sequence_length": "validation_lengths",
        "l2": "l2_loss",
        **{k: "reward_shaping" for k in ("add_len_reward", "difficulty_loss_weight", "length_loss_weight",
                                        "postive_loss_coef", "use_topr_neg_loss_coef", "use_topr_loss",
                                        "balance_length", "error_max_len_clip")},
        **{k: "their_values" for k in ("reward_norm", "reward_shift", "reward_scale")},
        "whiten_rewards": "reward_whitening",
        "use_policy_loss_type": "policy_loss_types",
        "importance_sampling": "sequence_ratios",
        "rl_loss_coef": "policy_loss_types",
        "actor_train.model_args.lora_dropout": "lora_dropout",
        "actor_train.training_args.*": "training_arguments",
        "critic.training_args.*": "training_arguments",
        **{f"{role}.worker_cls": "worker_classes" for role in ("actor_train", "actor_infer", "reference", "critic",
                                                              "validation")},
        "rewards.*.worker_cls": "generative_rm",
        **{f"{role}.model_args.model_type": "model_types" for role in ("actor_train", "actor_infer", "reference",
                                                                      "critic", "validation")},
        "actor_infer.generating_args.num_beams": "beam_search",
        "actor_infer.generating_args.repetition_penalty": "repetition_penalty",
    },
    "roll_dpo": {
        "checkpoint_config.type": "checkpoint_backends",
        "profiler_timeline": "profiler_kinds",
        "profiler_memory": "profiler_kinds",
        "async_generation_ratio": "partial_staleness",
        "actor_train.training_args.*": "training_arguments",
        "actor_train.worker_cls": "worker_classes",
        "reference.worker_cls": "worker_classes",
        "actor_train.model_args.model_type": "model_types",
        "reference.model_args.model_type": "model_types",
    },
    "trinity": {
        "algorithm.sample_strategy": "experience_sampling",
        "model.repetition_penalty": "repetition_penalty",
        "model.rope_scaling": "config_overrides",
        "model.rope_theta": "config_overrides",
        "model.tinker": "remote_training",
        "model.external_model": "external_models",
        "monitor.enable_ray_timeline": "ray_tooling",
        "buffer.explorer_input.taskset.rollout_args.n": "their_values",
        "buffer.explorer_input.taskset.rollout_args.*": "sampling_args",
        "buffer.explorer_input.taskset.storage_type": "data_services",
        "buffer.trainer_input.auxiliary_buffers": "sft_mixing",
        "explorer.over_rollout": "over_sampling",
        "explorer.dynamic_timeout": "runner_timeouts",
        "explorer.auxiliary_models": "external_models",
        "synchronizer.sync_style": "sync_styles",
        "trainer.trainer_type": "trainer_backends",
        "service": "data_services",
        "data_processor": "data_pipelines",
    },
    "atorch": {
        "model.*.optimizer.*": "frozen_roles",
        "model.*.model_cls": "external_model_code",
        "model.*.model_params.*": "loading_args",
        "model.*.model_params": "loading_args",
        "model.*.train_strategy": "strategy_code",
        "model.*.inference_strategy": "strategy_code",
        "model.actor_critic_ref": "shared_reference",
        "model.reward_critic": "shared_reference",
        "model.actor_critic_ref_reward": "shared_reference",
        "tokenizer.params.*": "tokenizer_args",
        "train.strategy_file": "strategy_code",
    },
    "trainer_config": {
        "generation_config.min_length": "min_total_length",
        "ppo_config.early_stopping": "kl_early_stop",
        "ppo_config.use_score_scaling": "reward_scaling",
        "ppo_config.use_score_norm": "reward_scaling",
        "ppo_config.score_clip": "score_clip_only",
        "ppo_config.whiten_rewards": "reward_whitening",
    },
}
# ROLL's agentic files are read by ROLL's table plus their environment sections (dialects/roll_agentic.py)
REFUSED_BECAUSE["roll_agentic"] = {**REFUSED_BECAUSE["roll"],
                                   **{f"{m}.{k}": lim for m in ("train_env_manager", "val_env_manager")
                                      for k, lim in (("group_size_redundancy", "their_values"),
                                                     ("generating_args.num_beams", "beam_search"))}}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One refusing rule: the format, their key (pattern), the rule's own reason and the limit it names."""

    fmt: str
    their: str
    reason: str
    limit: str | None


def refusals() -> Iterator[Refusal]:
    """Every refusing rule of every format: a rule that refuses some values of their key (``accept``) or whose
    conversion refuses (its docstring starts with "refused")."""
    from rlhf_jax.config import dialects
    from rlhf_jax.config.verl_compat import IGNORED

    for entry in IGNORED:
        if entry.accept is not None:
            yield Refusal("verl", entry.pattern, entry.reason, REFUSED_BECAUSE.get("verl", {}).get(entry.pattern))
    for fmt, module in dialects.TABLES.items():
        table = REFUSED_BECAUSE.get(fmt, {})
        for rule in module.RULES:
            doc = (rule.convert.__doc__ or "").strip() if rule.convert is not None else ""
            if (rule.accept is not None and not rule.maps) or doc.startswith("refused"):
                yield Refusal(fmt, rule.their, rule.reason or doc, table.get(rule.their))


def schema_keys_offering(limit: Limit, paths: tuple[str, ...]) -> list[str]:
    """The schema keys among ``paths`` that match one of ``limit.absent`` (none, while the limit holds)."""
    return [p for p in paths if any(fnmatch.fnmatchcase(p, pattern) for pattern in limit.absent)]
