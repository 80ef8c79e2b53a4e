"""verl keys that are not schema keys: other names of schema keys, and keys with no meaning in one JAX program.

:data:`ALIASES` are verl's other names for a schema key (``optim.clip_grad`` for
``grad_clip``, the DAPO ``reward_kwargs.overlong_buffer_cfg``): their value is
honoured. :data:`IGNORED` keys fall in three groups: the PyTorch/Ray/vLLM
machinery (FSDP wrapping, torch.compile, engine memory fractions, Ray settings),
deprecated verl aliases of keys we do have, and optional features we do not
implement; the last group is accepted only while the feature is switched off
(``accept``), otherwise it is an error, because silently training something else
would be worse. The importer lists the ignored keys of a file in one warning.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Ignored:
    """A verl key (fnmatch pattern over the dotted path) that the importer skips."""

    pattern: str
    reason: str
    accept: Callable[[Any], bool] | None = None  # None: any value; else the value must pass


def _off(value: Any) -> bool:
    """Feature disabled: False/None/0/-1/empty, a mapping whose ``enable`` (``enabled``) is falsy, or a mapping
    without that switch whose every setting is off (a mapping of real settings is on)."""
    if isinstance(value, dict):
        for switch in ("enable", "enabled"):
            if switch in value:
                return not value[switch]
        return all(_off(v) for k, v in value.items() if k != "_target_")
    return not value or value == -1


def _one(value: Any) -> bool:
    """Parallel size left at its no-op value."""
    return value in (None, 1)


def accepts_positive_size(value: Any) -> bool:
    """A parallel size a role may state: any positive count (or null)."""
    return value is None or (isinstance(value, int) and value >= 1)


def _unset(*names: str) -> Callable[[Any], bool]:
    """A mapping whose ``names`` are all null (a custom class or service that is not configured)."""
    return lambda value: value is None or (isinstance(value, dict) and all(value.get(n) is None for n in names))


def _empty(value: Any) -> bool:
    """Nothing given: null or an empty mapping (options that would change behaviour)."""
    return not value


def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value in allowed


@dataclasses.dataclass(frozen=True)
class Alias:
    """A verl key (exact dotted path) whose value sets schema key ``target``.

    ``assign=False``: the value must equal the target's final value (a copy verl keeps in two places), or
    ``fallback``'s where the target is None (derived from it).
    """

    path: str
    target: str
    assign: bool = True
    fallback: str | None = None


ALIASES: tuple[Alias, ...] = (
    # verl's optimizer config names the clipping norm and the schedule differently from the legacy keys.
    Alias("actor_rollout_ref.actor.optim.clip_grad", "actor_rollout_ref.actor.grad_clip"),
    Alias("critic.optim.clip_grad", "critic.grad_clip"),
    Alias("actor_rollout_ref.actor.optim.lr_scheduler_type", "actor_rollout_ref.actor.optim.warmup_style"),
    Alias("critic.optim.lr_scheduler_type", "critic.optim.warmup_style"),
    Alias("reward_manager.name", "reward_model.reward_manager"),
    # SAPO's temperatures sit beside the clip ratios in verl's actor config; accepted inside policy_loss too
    Alias("actor_rollout_ref.actor.policy_loss.tau_pos", "actor_rollout_ref.actor.tau_pos"),
    Alias("actor_rollout_ref.actor.policy_loss.tau_neg", "actor_rollout_ref.actor.tau_neg"),
    # verl's 2026 releases gather the reward settings in one ``reward`` section.
    Alias("reward.reward_manager.name", "reward_model.reward_manager"),
    Alias("reward.custom_reward_function.path", "custom_reward_function.path"),
    Alias("reward.custom_reward_function.name", "custom_reward_function.name"),
    Alias("actor_rollout_ref.model.tokenizer_path", "data.tokenizer"),
    Alias("actor_rollout_ref.model.custom_chat_template", "data.chat_template"),
    # DAPO keeps its overlong penalty in the reward manager's kwargs.
    Alias("reward_model.reward_kwargs.overlong_buffer_cfg.enable", "reward_model.overlong_buffer.enable"),
    Alias("reward_model.reward_kwargs.overlong_buffer_cfg.len", "reward_model.overlong_buffer.len"),
    Alias("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor",
          "reward_model.overlong_buffer.penalty_factor"),
    Alias("reward_model.reward_kwargs.max_resp_len", "actor_rollout_ref.rollout.response_length", assign=False,
          fallback="data.max_response_length"),
    Alias("actor_rollout_ref.actor.rollout_n", "actor_rollout_ref.rollout.n", assign=False),
    Alias("actor_rollout_ref.ref.rollout_n", "actor_rollout_ref.rollout.n", assign=False),
    Alias("critic.rollout_n", "actor_rollout_ref.rollout.n", assign=False),
    Alias("actor_rollout_ref.actor.use_remove_padding", "actor_rollout_ref.model.use_remove_padding", assign=False),
    Alias("actor_rollout_ref.rollout.prompt_length", "data.max_prompt_length", assign=False),
    # verl's FSDP engine computes in fsdp_config.dtype (mixed precision over model_dtype parameters); the reference
    # and the critic compute in the actor's dtype here, so their copies must agree with it.
    Alias("actor_rollout_ref.actor.fsdp_config.dtype", "actor_rollout_ref.model.compute_dtype"),
    Alias("actor_rollout_ref.actor.fsdp_config.model_dtype", "actor_rollout_ref.model.dtype"),  # its parameters
    Alias("actor_rollout_ref.ref.fsdp_config.dtype", "actor_rollout_ref.model.compute_dtype", assign=False),
    Alias("critic.model.fsdp_config.dtype", "actor_rollout_ref.model.compute_dtype", assign=False),
    # verl's newer critic engine section holds the critic's FSDP settings (critic.model.fsdp_config before).
    Alias("critic.fsdp.param_offload", "critic.model.fsdp_config.param_offload"),
    Alias("critic.fsdp.optimizer_offload", "critic.model.fsdp_config.optimizer_offload"),
    # verl's newer profiler section names the steps and the directory.
    Alias("global_profiler.steps", "trainer.profile_steps"),
    Alias("global_profiler.save_path", "trainer.profile_dir"),
    # Ulysses sequence parallelism: one mesh splits every role's passes along the sequence over mesh.context (the
    # reference's and the critic's sizes are read as the actor's: see IGNORED)
    Alias("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "mesh.context"),
    Alias("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size", "mesh.context"),
    # The critic and the reward model read responses with the policy's tokenizer here (verl's default too).
    Alias("critic.model.tokenizer_path", "data.tokenizer", assign=False, fallback="actor_rollout_ref.model.path"),
)


def find_alias(path: str) -> Alias | None:
    return next((a for a in ALIASES if a.path == path), None)


_MESH = "sharding comes from the mesh section"
_OFFLOAD = ("host offload of the reward model is not implemented: its parameters stay in device memory, sharded "
            "over mesh.fsdp (use more fsdp devices or bfloat16)")
_OFFLOAD_POLICY = ("FSDP2's CPU offload policy (the optimizer step on the host) is not implemented: set "
                   "fsdp_config.param_offload / optimizer_offload, which keep the arrays in host memory between "
                   "programs")
_RM_POOL = ("no separate reward-model pool: the reward model runs on the training mesh (set "
            "reward_model.enable_resource_pool=false; its devices are those of trainer.n_gpus_per_node)")
_ROLE_SPLIT = ("every role's passes are split over mesh.context, as the actor's "
               "(actor_rollout_ref.actor.ulysses_sequence_parallel_size)")
_ENGINE = "the sampler is the built-in JAX decode loop that reads the actor's parameters directly"

IGNORED: tuple[Ignored, ...] = (
    # on-policy distillation: the teacher runs in this program on the training mesh, in the reference's place
    Ignored("distillation.n_gpus_per_node", "the teacher shares the training devices (no separate pool)"),
    Ignored("distillation.nnodes", "the teacher shares the training devices (no separate pool)"),
    Ignored("distillation.teacher_models.teacher_model.inference", "the teacher's log-probs come from a forward "
            "pass of this program (no inference engine)"),
    Ignored("distillation.teacher_models.teacher_model.num_replicas", "the teacher shares the training devices"),
    Ignored("distillation.teacher_models.teacher_model.key", "one teacher for every row"),
    Ignored("distillation.teacher_key", "one teacher for every row"),
    Ignored("distillation.distillation_loss.use_chunked_topk", "forward_kl_topk's memory option: the logits are "
            "always formed chunk by chunk here, never whole"),
    Ignored("distillation.distillation_loss.chunked_topk_chunk_size", "forward_kl_topk's memory option: the chunk "
            "follows the logits' memory budget (algos.entropy.auto_chunk_size)"),
    Ignored("defaults", "Hydra defaults list: the file is read on its own"),
    Ignored("hydra", "Hydra runtime settings"),
    Ignored("_target_", "verl dataclass target"),
    Ignored("*._target_", "verl dataclass target"),
    Ignored("ray_init", "no Ray: one JAX program per host"),
    Ignored("ray_kwargs", "no Ray: one JAX program per host"),
    Ignored("global_profiler.tool", "jax.profiler records the trainer.profile_steps (nsys/npu/torch do not apply)"),
    Ignored("global_profiler.global_tool_config", "jax.profiler records the trainer.profile_steps (nsys/npu/torch "
            "do not apply)"),
    Ignored("global_profiler.profile_continuous_steps", "each of trainer.profile_steps is traced on its own"),
    Ignored("transfer_queue", "no Ray data transfer: one JAX program"),
    Ignored("*.profiler", "per-role profiling: list the steps in trainer.profile_steps (one jax.profiler trace "
            "covers every role)", _off),
    Ignored("*.strategy", f"fsdp/megatron backend choice: {_MESH}"),
    # FSDP engine settings, one by one: wrapping and prefetching have no JAX meaning; offload, mixed precision and
    # determinism would change memory or numbers, so they are refused unless off.
    Ignored("*.fsdp_config.wrap_policy", f"FSDP wrapping: {_MESH}"),
    Ignored("*.fsdp_config.reshard_after_forward", f"FSDP resharding: {_MESH}"),
    Ignored("*.fsdp_config.forward_prefetch", "XLA schedules the parameter gathers"),
    Ignored("*.fsdp_config.backward_prefetch", "XLA schedules the parameter gathers"),
    Ignored("*.fsdp_config.limit_all_gathers", "XLA schedules the parameter gathers"),
    Ignored("*.fsdp_config.use_orig_params", "FSDP parameter flattening"),
    Ignored("*.fsdp_config.forward_only", "the reference never builds a backward pass"),
    Ignored("*.fsdp_config.seed", "seeds come from trainer.seed"),
    Ignored("*.fsdp_config.fsdp_size", "FSDP group size: set mesh.fsdp", _is(-1, None)),
    Ignored("*.fsdp_config.model_dtype", "the reference and the critic hold the actor's parameter dtype "
            "(actor_rollout_ref.actor.fsdp_config.model_dtype, actor_rollout_ref.model.dtype)",
            _is("fp32", "float32", None)),
    Ignored("*.fsdp_config.dtype", "FSDP compute dtype of another role: the reward model computes in float32",
            _is("float32", "fp32", None)),
    Ignored("*.fsdp_config.mixed_precision", "set actor_rollout_ref.model.compute_dtype (matmuls) and "
            "actor_rollout_ref.model.dtype (parameters, optimizer state)", _empty),
    # the actor's, the critic's and the reference's parameter (and optimizer-state) offload are schema keys
    # (honoured); the reward model's is not
    Ignored("reward_model.*fsdp_config.param_offload", _OFFLOAD, _off),
    Ignored("actor_rollout_ref.ref.fsdp_config.optimizer_offload", "the reference has no optimizer (verl ignores "
            "it too)"),
    Ignored("reward_model.*fsdp_config.optimizer_offload", "the reward model has no optimizer (verl ignores it too)"),
    Ignored("*.fsdp_config.offload_policy", _OFFLOAD_POLICY, _off),
    Ignored("*.fsdp_config.full_determinism", "deterministic kernels: set XLA_FLAGS=--xla_gpu_deterministic_ops=true",
            _off),
    Ignored("*.megatron", f"Megatron parallelism: {_MESH}"),
    Ignored("*.use_torch_compile", "every step is compiled with jax.jit"),
    Ignored("critic.*ulysses_sequence_parallel_size", _ROLE_SPLIT, accepts_positive_size),
    Ignored("actor_rollout_ref.ref.*ulysses_sequence_parallel_size", _ROLE_SPLIT, accepts_positive_size),
    Ignored("reward_model.ulysses_sequence_parallel_size", "the reward model scores whole sequences on each device",
            _one),
    Ignored("*.enable_activation_offload", "activation offload is not implemented: set enable_gradient_checkpointing "
            "(remat) to save activation memory", _off),
    Ignored("*.use_fused_kernels", "XLA fuses kernels"),
    Ignored("*.fused_kernel_options", "XLA fuses kernels"),
    Ignored("*.use_liger", "XLA fuses kernels"),
    Ignored("*.entropy_from_logits_with_chunking", "entropy and log-probs are always computed in chunks"),
    Ignored("*.entropy_checkpointing", "entropy and log-probs are always computed in chunks"),
    Ignored("*.trust_remote_code", "models are the built-in Flax implementations; no remote code runs"),
    Ignored("*.external_lib", "models are the built-in Flax implementations; no external model code runs", _off),
    Ignored("*.use_shm", "checkpoints are read from disk directly"),
    Ignored("*.override_config", "Hugging Face config overrides (dropout) do not apply: no dropout", _empty),
    Ignored("critic.model.lora_rank", "LoRA is implemented for the actor only", _off),
    Ignored("critic.model.lora_alpha", "LoRA is implemented for the actor only"),
    Ignored("critic.model.target_modules", "LoRA is implemented for the actor only"),
    Ignored("*.exclude_modules", "LoRA exclude_modules is not implemented: list target_modules instead", _off),
    Ignored("*.data_loader_seed", "the data order comes from data.seed"),
    Ignored("*.optim.total_training_steps", "derived by finalize from trainer.total_training_steps / the data"),
    Ignored("*.checkpoint.async_save", "Orbax saves asynchronously"),
    Ignored("*.ppo_micro_batch_size", "deprecated global size: set ppo_micro_batch_size_per_gpu", _off),
    Ignored("*.log_prob_micro_batch_size", "deprecated global size: set log_prob_micro_batch_size_per_gpu", _off),
    Ignored("*.micro_batch_size", "deprecated global size: set micro_batch_size_per_gpu", _off),
    Ignored("critic.forward_micro_batch_size", "deprecated global size: set forward_micro_batch_size_per_gpu",
            _off),
    Ignored("actor_rollout_ref.hybrid_engine", "actor and sampler always share parameters in one program"),
    Ignored("actor_rollout_ref.rollout.name", _ENGINE),
    Ignored("actor_rollout_ref.rollout.mode", "the sampler runs inside the training program (sync and async give the "
            "same samples)", _is("sync", "async")),
    Ignored("actor_rollout_ref.rollout.sglang_rollout_mode", _ENGINE),  # verl 0.4-0.5's SGLang engine or HTTP server
    Ignored("actor_rollout_ref.rollout.server.*", "settings of an inference server: " + _ENGINE),
    Ignored("actor_rollout_ref.rollout.gpu_memory_utilization", "the KV cache is sized from the batch and lengths"),
    Ignored("actor_rollout_ref.rollout.enforce_eager", "no CUDA graphs: the decode loop is jit-compiled"),
    Ignored("actor_rollout_ref.rollout.free_cache_engine", "the KV cache is freed after each rollout"),
    Ignored("actor_rollout_ref.rollout.load_format", _ENGINE),
    Ignored("actor_rollout_ref.rollout.layered_summon", _ENGINE),
    Ignored("actor_rollout_ref.rollout.tensor_model_parallel_size", f"sampler tensor parallelism: {_MESH}"),
    Ignored("actor_rollout_ref.rollout.max_num_batched_tokens", "vLLM scheduler setting"),
    Ignored("actor_rollout_ref.rollout.max_model_len", "vLLM scheduler setting"),
    Ignored("actor_rollout_ref.rollout.enable_chunked_prefill", "vLLM scheduler setting"),
    Ignored("actor_rollout_ref.rollout.enable_prefix_caching", "vLLM scheduler setting"),
    Ignored("actor_rollout_ref.rollout.disable_log_stats", "vLLM logging setting"),
    Ignored("actor_rollout_ref.rollout.engine_kwargs", "vLLM / SGLang engine arguments"),
    Ignored("actor_rollout_ref.rollout.calculate_log_probs", "old log-probs are recomputed by the actor"),
    Ignored("actor_rollout_ref.rollout.update_weights_bucket_megabytes", _ENGINE),
    Ignored("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", "repeated multi-turn rollouts are not "
            "implemented: set rollout.n", _off),
    Ignored("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", "turns are kept as sampled, token "
            "for token; the chat template renders only the tool responses"),
    Ignored("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", "nothing is re-tokenized: "
            "turns are kept as sampled"),
    Ignored("actor_rollout_ref.rollout.agent", "agent loops are not implemented: single-turn sampling",
            lambda v: not isinstance(v, dict) or (v.get("default_agent_loop") in (None, "single_turn_agent")
                                                  and not v.get("agent_loop_config_path")
                                                  and _unset("path")(v.get("custom_async_server")))),
    Ignored("data.return_raw_input_ids", "reward models re-tokenize decoded text (reward_model.model.input_tokenizer)"),
    Ignored("data.return_raw_chat", "raw prompts are always kept for reward functions"),
    Ignored("data.return_full_prompt", "prompt texts are always kept for logging"),
    Ignored("data.return_multi_modal_inputs", "multi-modal data is not supported (text rows have no such inputs)"),
    Ignored("data.custom_cls", "custom dataset classes: convert the data to parquet/json/jsonl/csv",
            _unset("path")),
    Ignored("data.filter_overlong_prompts_workers", "prompts are filtered in-process"),
    Ignored("data.dataloader_num_workers", "the grain pipeline reads pre-tokenized prompts in-process"),
    Ignored("data.trust_remote_code", "tokenizers are loaded without remote code"),
    Ignored("data.sampler", "custom samplers: the data order comes from data.shuffle and data.seed",
            _unset("class_path")),
    Ignored("data.datagen", "dynamic data generation: use builtin:<name> data files", _unset("path")),
    Ignored("reward_model.strategy", f"reward-model backend: {_MESH}"),
    Ignored("reward_model.launch_reward_fn_async", "scoring runs inside the step: set reward_model.reward_manager=prime "
            "for parallel worker processes", _off),
    Ignored("reward_model.sandbox_fusion", "sandboxed code execution is not implemented", _unset("url")),
    Ignored("reward_model.reward_kwargs.overlong_buffer_cfg.log", "overlong-penalty metrics are always logged"),
    Ignored("algorithm.use_pf_ppo", "prioritized-replay PPO is not implemented", _off),
    Ignored("algorithm.pf_ppo", "prioritized-replay PPO is not implemented"),
    Ignored("trainer.device", "JAX picks the platform (JAX_PLATFORMS)"),
    Ignored("trainer.default_hdfs_dir", "verl's checkpoint managers do not copy there either: checkpoints stay in "
            "trainer.default_local_dir"),
    Ignored("trainer.del_local_ckpt_after_load", "local checkpoints are kept", _off),
    Ignored("trainer.ray_wait_register_center_timeout", "no Ray"),
    Ignored("trainer.balance_batch", "no per-rank length balancing: batches are padded to static shapes"),
    Ignored("trainer.profile_continuous_steps", "each of trainer.profile_steps is traced on its own"),
    Ignored("trainer.npu_profile", "NPU profiler settings: jax.profiler records trainer.profile_steps"),
    Ignored("trainer.use_legacy_worker_impl", "no Ray workers"),
    Ignored("trainer.esi_redundant_time", "no elastic-instance preemption handling; checkpoints resume instead"),
    Ignored("trainer.controller_nsight_options", "Nsight settings: jax.profiler records trainer.profile_steps"),
    Ignored("trainer.worker_nsight_options", "Nsight settings: jax.profiler records trainer.profile_steps"),
    # verl's current (engine-based) config.
    Ignored("*.nccl_timeout", "no NCCL process groups: one JAX program"),
    Ignored("*.optim.optimizer_impl", "optimizers come from optax (see optim.optimizer)"),
    Ignored("*.tiled_mlp", "tiled MLP memory saving: use enable_gradient_checkpointing", _off),
    Ignored("*.router_replay._target_", "verl's config class"),
    Ignored("*.router_replay.record_file", "routes stay in the step's arrays (router_replay.mode)", _off),
    Ignored("*.router_replay.replay_file", "routes stay in the step's arrays (router_replay.mode)", _off),
    Ignored("actor_rollout_ref.ref.router_replay.mode", "the reference pass follows actor_rollout_ref.actor."
            "router_replay.mode (R3: it replays the sampler's routes)"),
    Ignored("actor_rollout_ref.actor.*.router_replay.mode", "the engine's copy of actor_rollout_ref.actor."
            "router_replay.mode (which is read)"),
    Ignored("actor_rollout_ref.actor.freeze_vision_tower", "multi-modal models are not supported", _off),
    Ignored("actor_rollout_ref.actor.calculate_entropy", "the entropy is always computed and logged"),
    Ignored("actor_rollout_ref.actor.use_prefix_grouper", "the same losses without grouping shared prefixes"),
    Ignored("actor_rollout_ref.actor.sum_pi_squared_checkpointing", "sum_pi_squared is computed chunk by chunk with "
            "the log-probs: no vocabulary-sized tensor to recompute"),
    Ignored("actor_rollout_ref.model.hf_config_path", "the config.json in actor_rollout_ref.model.path is used", _off),
    Ignored("actor_rollout_ref.model.mtp", "multi-token prediction is not implemented", _off),
    Ignored("actor_rollout_ref.rollout.mtp", "multi-token prediction is not implemented", _off),
    Ignored("actor_rollout_ref.rollout.cudagraph_capture_sizes", "no CUDA graphs: the decode loop is jit-compiled"),
    Ignored("actor_rollout_ref.rollout.data_parallel_size", f"sampler data parallelism: {_MESH}", _one),
    Ignored("actor_rollout_ref.rollout.expert_parallel_size", f"sampler expert parallelism: {_MESH}", _one),
    Ignored("actor_rollout_ref.rollout.pipeline_model_parallel_size", f"sampler pipeline parallelism: {_MESH}", _one),
    Ignored("actor_rollout_ref.rollout.logprobs_mode", "old log-probs are recomputed by the actor"),
    Ignored("actor_rollout_ref.rollout.scheduling_policy", "vLLM scheduler setting"),
    Ignored("actor_rollout_ref.rollout.multi_stage_wake_up", _ENGINE),
    Ignored("actor_rollout_ref.rollout.checkpoint_engine", _ENGINE),
    Ignored("actor_rollout_ref.rollout.trace", "rollout tracing is not implemented", _unset("backend")),
    Ignored("actor_rollout_ref.rollout.skip_rollout", "rollout dumps and replays are not implemented", _off),
    Ignored("actor_rollout_ref.rollout.skip_dump_dir", "rollout dumps and replays are not implemented"),
    Ignored("actor_rollout_ref.rollout.skip_tokenizer_init", _ENGINE),
    Ignored("actor_rollout_ref.rollout.enable_rollout_routing_replay", "the sampler records routes exactly when "
            "actor_rollout_ref.actor.router_replay.mode=R3"),
    Ignored("actor_rollout_ref.rollout.prometheus", "no inference server metrics", _off),
    Ignored("actor_rollout_ref.rollout.quantization", "quantized sampling is not implemented", _off),
    Ignored("actor_rollout_ref.rollout.quantization_config_file", "quantized sampling is not implemented", _off),
    Ignored("data.reward_fn_key", "the scorer is chosen by the data_source column", _is("data_source")),
    Ignored("data.tool_config_path", "verl's copy of actor_rollout_ref.rollout.multi_turn.tool_config_path "
            "(which is read)"),
    Ignored("data.image_patch_size", "multi-modal data is not supported"),
    Ignored("data.validation_shuffle", "validation metrics do not depend on the order"),
    Ignored("reward_manager.source", "reward managers are chosen by name (reward_model.reward_manager)",
            _is("register")),
    Ignored("reward_manager.module", "custom reward-manager modules: use custom_reward_function", _unset("path")),
    Ignored("reward_model.enable_resource_pool", _RM_POOL, _off),
    # verl sizes the reward model's own pool with these only under enable_resource_pool, refused above.
    Ignored("reward_model.n_gpus_per_node", "size of a separate reward-model pool (reward_model.enable_resource_pool "
            "is refused): the reward model shares the trainer.n_gpus_per_node devices"),
    Ignored("reward_model.nnodes", "size of a separate reward-model pool (reward_model.enable_resource_pool is "
            "refused): the reward model shares the trainer.nnodes hosts"),
    Ignored("reward_model.model.use_remove_padding", "reward-model batches are padded"),
    Ignored("reward_model.use_dynamic_bsz", "reward-model batches are reward_model.micro_batch_size_per_gpu rows"),
    Ignored("reward_model.forward_max_token_len_per_gpu", "reward-model batches are micro_batch_size_per_gpu rows"),
    Ignored("reward_model.reward_loop_source", "reward managers are chosen by name (reward_model.reward_manager)",
            _is("register")),
    Ignored("reward_model.reward_loop_module_path", "custom reward loops: use custom_reward_function", _off),
    Ignored("reward_model.reward_loop_class_name", "custom reward loops: use custom_reward_function", _off),
    Ignored("reward_model.use_reward_loop", "scoring runs in the trainer (reward_model.reward_manager)"),
    Ignored("reward_model.rollout", "generative reward models are not implemented: the reward model is a classifier "
            "(leave reward_model.rollout.name unset)",
            lambda v: not isinstance(v, dict) or v.get("name") in (None, "???")),
)


def find_ignored(path: str) -> Ignored | None:
    """The :class:`Ignored` entry matching dotted ``path``, if any; an exact entry wins over a wildcard one."""
    if path.startswith("critic.fsdp."):  # verl's newer critic engine section holds the same FSDP settings
        path = "critic.fsdp_config." + path[len("critic.fsdp."):]
    for entry in IGNORED:
        if entry.pattern == path:
            return entry
    for entry in IGNORED:
        if fnmatch.fnmatchcase(path, entry.pattern):
            return entry
    return None
