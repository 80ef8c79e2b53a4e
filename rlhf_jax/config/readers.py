"""Which module reads each schema key: the evidence that an accepted key does something.

:data:`READERS` maps a consumer module to the keys (fnmatch patterns over dotted paths) whose values it
reads; :data:`NO_OPS` lists the keys that are accepted on purpose without an effect, with the reason.
``tests/config/test_readers.py`` checks that every schema key is in one of the two, that every listed module
exists and still mentions each of its keys (their last name, or the ``EVIDENCE`` text of keys read under
a computed name), that no entry names a key the schema lacks, and that every verl name in
:mod:`rlhf_jax.config.verl_compat` leads to a read key or is an ignored key with its reason. A key added
to the schema without a consumer fails that test.
"""

from __future__ import annotations

_A = "actor_rollout_ref."

READERS: dict[str, tuple[str, ...]] = {
    "rlhf_jax.data.loader": (
        "data.train_files", "data.val_files", "data.train_split", "data.val_split", "data.train_max_samples",
        "data.val_max_samples", "data.prompt_key", "data.ground_truth_key", "data.default_data_source",
        "data.image_key", "data.video_key", "data.prompt_template", "data.system_prompt",
        "data.apply_chat_template_kwargs", "data.max_prompt_length", "data.prompt_length_buckets", "data.truncation",
        "data.filter_overlong_prompts", "data.train_batch_size", "data.val_batch_size", "data.shuffle", "data.seed",
        "data.domain_weights", "data.domain_key", "data.domain_tags", "data.tag_key", "data.default_domain",
    ),
    "rlhf_jax.train.setup": (
        "distillation.teacher_models.teacher_model.model_path",
        "data.tokenizer", "data.chat_template", _A + "model.path", _A + "model.revision", _A + "model.dtype", _A + "model.compute_dtype",
        _A + "model.enable_gradient_checkpointing", _A + "model.remat_policy", _A + "model.attn_implementation",
        "critic.model.enable_gradient_checkpointing", "critic.model.remat_policy", "mesh.logical_axis_rules",
        _A + "model.lora_rank", _A + "model.lora_alpha", _A + "model.target_modules", _A + "model.lora_adapter_path",
        "mesh.rollout_devices", "mesh.rollout_processes", "mesh.context_attention", "trainer.n_gpus_per_node",
        _A + "rollout.dtype",
        _A + "ref.fsdp_config.param_offload",
        _A + "actor.fsdp_config.param_offload", _A + "actor.fsdp_config.optimizer_offload",
        "critic.model.fsdp_config.param_offload", "critic.model.fsdp_config.optimizer_offload",
    ),
    "rlhf_jax.config.validate": ("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.expert", "mesh.context"),
    # read as the default of other keys (same_as): the sampler's length, the clip bounds
    "rlhf_jax.config.keys_policy": ("data.max_response_length", _A + "actor.clip_ratio"),
    "rlhf_jax.config.defaults": ("trainer.remove_previous_ckpt_in_save",),
    "rlhf_jax.config.rules_run": ("experience.max_staleness",),
    "rlhf_jax.config.placement": ("trainer.nnodes", "trainer.n_gpus_per_node"),
    "rlhf_jax.config.derive": (
        _A + "actor.ppo_mini_batch_size", _A + "actor.ppo_micro_batch_size_per_gpu", _A + "actor.ppo_epochs",
        _A + "ref.log_prob_micro_batch_size_per_gpu", _A + "rollout.log_prob_micro_batch_size_per_gpu",
        "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu", "critic.forward_micro_batch_size_per_gpu",
        "critic.ppo_epochs", "trainer.total_epochs", "trainer.total_training_steps", _A + "actor.use_kl_loss",
        "algorithm.use_kl_in_reward", _A + "actor.calculate_sum_pi_squared",
    ),
    "rlhf_jax.train.passes": (
        _A + "actor.router_replay.mode", _A + "model.use_remove_padding", _A + "actor.use_dynamic_bsz", _A + "actor.ppo_max_token_len_per_gpu",
        _A + "ref.log_prob_use_dynamic_bsz", _A + "ref.log_prob_max_token_len_per_gpu",
        _A + "rollout.log_prob_use_dynamic_bsz", _A + "rollout.log_prob_max_token_len_per_gpu",
        "critic.model.use_remove_padding", "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu",
        "critic.forward_max_token_len_per_gpu", "distillation.distillation_loss.topk",
    ),
    "rlhf_jax.train.optim": (_A + "actor.optim.*", "critic.optim.*"),
    "rlhf_jax.train.freeze": (_A + "actor.freeze.*",),
    "rlhf_jax.train.tasks": ("algorithm.type",),
    "rlhf_jax.train.trainer_experience": ("experience.buffer_size", "experience.overlap"),
    "rlhf_jax.train.dpo": ("algorithm.dpo.*",),
    "rlhf_jax.data.preferences": ("data.chosen_key", "data.rejected_key", "data.max_length"),
    "rlhf_jax.train.trainer_checkpoints": (_A + "actor.checkpoint.*", "critic.checkpoint.*"),
    "rlhf_jax.train.split_run": ("mesh.handoff_timeout_s", "mesh.rollout_processes", "experience.partial_rollout_tokens",
                                 "experience.partial_rollout_wait"),
    "rlhf_jax.train.trainer": (
        _A + "actor.shuffle", _A + "actor.grad_clip", _A + "actor.clip_ratio_low", _A + "actor.clip_ratio_high",
        _A + "actor.clip_ratio_c", _A + "actor.entropy_coeff", _A + "actor.kl_loss_coef",
        _A + "actor.router_aux_loss_coef", _A + "actor.kl_loss_type", _A + "actor.tis_imp_ratio_cap", _A + "actor.loss_agg_mode",
        _A + "actor.loss_scale_factor", _A + "actor.policy_loss.*", _A + "actor.tau_pos", _A + "actor.tau_neg",
        "critic.enable", "critic.shared_trunk", "critic.vf_coef", "critic.model.path", "critic.model.revision",
        "critic.shuffle", "critic.grad_clip",
        "critic.cliprange_value", "critic.loss_agg_mode", "reward_model.enable", "algorithm.adv_estimator",
        "algorithm.gamma", "algorithm.lam", "algorithm.norm_adv_by_std_in_grpo", "algorithm.kl_penalty",
        "algorithm.gdpo_reward_keys", "algorithm.gdpo_reward_weights", "algorithm.rollout_correction.bypass_mode",
        "algorithm.rollout_correction.loss_type", "algorithm.filter_groups.enable", "distillation.enabled",
        *(f"distillation.distillation_loss.{k}" for k in (
            "loss_mode", "use_task_rewards", "distillation_loss_coef", "loss_max_clamp", "use_policy_gradient",
            "clip_ratio_low", "clip_ratio_high", "log_prob_min_clamp")), "algorithm.kl_ctrl.*",
        "trainer.validation_data_dir", "trainer.log_val_generations", "trainer.critic_warmup", "trainer.resume_mode",
        "trainer.max_actor_ckpt_to_keep", "trainer.seed",
        # ScoreShaping and the advantage stage's settings (ROLL's RLVR options)
        "algorithm.reward_norm.*", "algorithm.reward_clip", "algorithm.whiten_advantages", "algorithm.advantage_clip",
        "algorithm.sample_mask.*",
    ),
    "rlhf_jax.train.trainer_rollout": ("algorithm.filter_groups.*", "trainer.rollout_data_dir", _A + "rollout.weight_dtype"),
    "rlhf_jax.train.fit_loop": (
        "trainer.default_local_dir", "trainer.log_dir", "trainer.save_freq", "trainer.test_freq",
        "trainer.val_before_train", "trainer.val_only", "trainer.save_hf_checkpoint", "trainer.resume_from_path",
        "trainer.profile_steps", "trainer.profile_dir",
    ),
    "rlhf_jax.runtime.loggers": ("trainer.logger", "trainer.log_dir"),
    "rlhf_jax.agents.multi_turn": (_A + "rollout.multi_turn.enable", _A + "rollout.multi_turn.workflow_args",
                                  _A + "rollout.multi_turn.per_turn_rewards", _A + "rollout.over_sample_rate"),
    "rlhf_jax.agents.settings": tuple(_A + "rollout.multi_turn." + k for k in (
        "max_assistant_turns", "max_user_turns", "max_tokens_per_turn", "tools", "tool_config_path", "format",
        "max_parallel_calls", "max_tool_response_length", "tool_response_truncate_side", "tool_timeout_s",
        "environment", "environments", "workflow", "interaction_config_path")),
    "rlhf_jax.data.sft": ("data.response_key", "data.multiturn.*", "data.max_length"),
    "rlhf_jax.train.sft": ("data.micro_batch_size_per_gpu", "trainer.val_accuracy"),
    "rlhf_jax.train.stages": ("stages",),
    "rlhf_jax.main": ("trainer.env_vars",),  # applied before the distributed runtime starts
    "rlhf_jax.runtime.trackers": ("trainer.project_name", "trainer.experiment_name"),
    "rlhf_jax.rollout.params": tuple(_A + "rollout." + k for k in (  # SamplingParams.from_config
        "n", "temperature", "top_k", "top_p", "do_sample", "response_length", "ignore_eos", "min_new_tokens", "seed",
        "max_num_seqs", "val_kwargs.*")),
    "rlhf_jax.rewards.manager": (
        "reward_model.reward_manager", "reward_model.num_workers", "reward_model.timeout_s",
        "reward_model.fail_on_error", "reward_model.overlong_buffer.*",
    ),
    "rlhf_jax.rewards.custom": (
        "custom_reward_function.path", "custom_reward_function.name", "reward_model.scorer_kwargs",
        "reward_model.answer_match",
    ),
    "rlhf_jax.rewards.reward_model": (
        "reward_model.model.path", "reward_model.model.revision", "reward_model.micro_batch_size_per_gpu",
        "reward_model.max_length",
    ),
    # the RolloutCorrection dataclass's fields are the section's keys (correction_from_config)
    "rlhf_jax.algos.rollout_correction": tuple(f"algorithm.rollout_correction.{k}" for k in (
        "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold",
        "rollout_rs_threshold_lower", "rollout_token_veto_threshold")),
    # Accepted only when it names the policy's tokenizer (what responses are decoded with here, as in verl).
    "rlhf_jax.config.rules": ("reward_model.model.input_tokenizer", "trainer.max_critic_ckpt_to_keep"),
}

# Keys read under a computed name ({which}_files, ...): the text the module must contain instead of the last name.
EVIDENCE: dict[str, str] = {
    "data.train_files": "_files", "data.val_files": "_files", "data.train_split": "_split",
    "data.val_split": "_split", "data.train_max_samples": "_max_samples", "data.val_max_samples": "_max_samples",
    **{_A + f"actor.freeze.freeze_{g}": 'f"freeze_{g}"' for g in ("emb", "ln", "attn", "ff", "other")},
}

# Keys accepted on purpose with no effect of their own.
NO_OPS: dict[str, str] = {
    "distillation.distillation_loss.policy_loss_mode": "vanilla, its one value (verl's too), is the loss of "
                                                       "use_policy_gradient",
    "distillation.distillation_loss.clip_ratio": "the default of clip_ratio_low / clip_ratio_high (same_as)",
}
