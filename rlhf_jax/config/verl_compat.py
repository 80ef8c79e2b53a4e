"""verl keys that have no meaning in one JAX program, accepted (with a warning) by the YAML importer.

They fall in three groups: the PyTorch/Ray/vLLM machinery (FSDP wrapping,
torch.compile, engine memory fractions, node counts), deprecated verl aliases
of keys we do have, and optional features we do not implement; the last group
is accepted only while the feature is switched off (``accept``), otherwise
it is an error, because silently training something else would be worse.
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
    """Feature disabled: False/None/0/empty, or a mapping whose ``enable`` is falsy."""
    if isinstance(value, dict):
        return not value.get("enable", value.get("enabled", False))
    return not value or value == -1


def _one(value: Any) -> bool:
    """Parallel size left at its no-op value."""
    return value in (None, 1)


_MESH = "sharding comes from the mesh section"
_ENGINE = "the sampler is the built-in JAX decode loop that reads the actor's parameters directly"

IGNORED: tuple[Ignored, ...] = (
    Ignored("defaults", "Hydra defaults list: the file is read on its own"),
    Ignored("hydra", "Hydra runtime settings"),
    Ignored("_target_", "verl dataclass target"),
    Ignored("*._target_", "verl dataclass target"),
    Ignored("ray_init", "no Ray: one JAX program per host"),
    Ignored("ray_kwargs", "no Ray: one JAX program per host"),
    Ignored("global_profiler", "use the JAX profiler"),
    Ignored("transfer_queue", "no Ray data transfer: one JAX program"),
    Ignored("*.profiler", "use the JAX profiler"),
    Ignored("*.strategy", f"fsdp/megatron backend choice: {_MESH}"),
    Ignored("*.fsdp_config", f"FSDP wrapping and offload: {_MESH}"),
    Ignored("*.megatron", f"Megatron parallelism: {_MESH}"),
    Ignored("*.use_torch_compile", "every step is compiled with jax.jit"),
    Ignored("*.ulysses_sequence_parallel_size", f"Ulysses sequence parallelism: {_MESH}", _one),
    Ignored("*.enable_activation_offload", "activation offload: use enable_gradient_checkpointing"),
    Ignored("*.use_fused_kernels", "XLA fuses kernels"),
    Ignored("*.fused_kernel_options", "XLA fuses kernels"),
    Ignored("*.use_liger", "XLA fuses kernels"),
    Ignored("*.entropy_from_logits_with_chunking", "entropy and log-probs are always computed in chunks"),
    Ignored("*.entropy_checkpointing", "entropy and log-probs are always computed in chunks"),
    Ignored("*.trust_remote_code", "models are the built-in Flax implementations; no remote code runs"),
    Ignored("*.external_lib", "models are the built-in Flax implementations"),
    Ignored("*.use_shm", "checkpoints are read from disk directly"),
    Ignored("*.override_config", "Hugging Face config overrides (dropout) do not apply: no dropout", _off),
    Ignored("*.lora_rank", "LoRA is not implemented", _off),
    Ignored("*.lora_alpha", "LoRA is not implemented"),
    Ignored("*.target_modules", "LoRA is not implemented"),
    Ignored("*.exclude_modules", "LoRA is not implemented"),
    Ignored("*.data_loader_seed", "the data order comes from data.seed"),
    Ignored("*.optim.total_training_steps", "derived by finalize from trainer.total_training_steps / the data"),
    Ignored("*.optim.optimizer", "the optimizer is AdamW", lambda v: str(v).lower() in ("adam", "adamw")),
    Ignored("*.checkpoint.async_save", "Orbax saves asynchronously"),
    Ignored("*.ppo_micro_batch_size", "deprecated global size: set ppo_micro_batch_size_per_gpu", _off),
    Ignored("*.log_prob_micro_batch_size", "deprecated global size: set log_prob_micro_batch_size_per_gpu", _off),
    Ignored("*.micro_batch_size", "deprecated global size: set micro_batch_size_per_gpu", _off),
    Ignored("critic.forward_micro_batch_size", "deprecated global size: set forward_micro_batch_size_per_gpu",
            _off),
    Ignored("critic.rollout_n", "taken from actor_rollout_ref.rollout.n"),
    Ignored("critic.model.tokenizer_path", "the critic uses the policy tokenizer"),
    Ignored("actor_rollout_ref.hybrid_engine", "actor and sampler always share parameters in one program"),
    Ignored("actor_rollout_ref.model.custom_chat_template", "chat templates come from the tokenizer", _off),
    Ignored("actor_rollout_ref.actor.tis_imp_ratio_cap", "sampler and trainer log-probs come from the same model",
            _off),
    Ignored("actor_rollout_ref.rollout.name", _ENGINE),
    Ignored("actor_rollout_ref.rollout.mode", _ENGINE),
    Ignored("actor_rollout_ref.rollout.dtype", "the sampler uses actor_rollout_ref.model.dtype / compute_dtype"),
    Ignored("actor_rollout_ref.rollout.prompt_length", "use data.max_prompt_length"),
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
    Ignored("actor_rollout_ref.rollout.multi_turn", "multi-turn rollouts are not implemented", _off),
    Ignored("actor_rollout_ref.rollout.agent", "agent loops are not implemented"),
    Ignored("data.return_raw_input_ids", "reward models re-tokenize decoded text (reward_model.model.input_tokenizer)"),
    Ignored("data.return_raw_chat", "raw prompts are always kept for reward functions"),
    Ignored("data.return_full_prompt", "prompt texts are always kept for logging"),
    Ignored("data.return_multi_modal_inputs", "multi-modal data is not supported", _off),
    Ignored("data.image_key", "multi-modal data is not supported"),
    Ignored("data.video_key", "multi-modal data is not supported"),
    Ignored("data.custom_cls", "custom dataset classes: convert the data to parquet/json/jsonl/csv", _off),
    Ignored("data.filter_overlong_prompts_workers", "prompts are filtered in-process"),
    Ignored("data.dataloader_num_workers", "the grain pipeline reads pre-tokenized prompts in-process"),
    Ignored("data.trust_remote_code", "tokenizers are loaded without remote code"),
    Ignored("data.sampler", "the data order comes from data.shuffle and data.seed", _off),
    Ignored("data.datagen", "use builtin:<name> data files", _off),
    Ignored("reward_model.strategy", f"reward-model backend: {_MESH}"),
    Ignored("reward_model.launch_reward_fn_async", "scoring runs in worker processes (reward_manager=prime)"),
    Ignored("reward_model.sandbox_fusion", "sandboxed code execution is not implemented", _off),
    Ignored("reward_model.reward_kwargs", "scorer options are not configurable from YAML", _off),
    Ignored("algorithm.use_pf_ppo", "prioritized-replay PPO is not implemented", _off),
    Ignored("algorithm.pf_ppo", "prioritized-replay PPO is not implemented"),
    Ignored("algorithm.filter_groups", "DAPO dynamic sampling (group filtering) is not implemented", _off),
    Ignored("trainer.nnodes", "devices come from JAX (jax.devices()) and the mesh section"),
    Ignored("trainer.n_gpus_per_node", "devices come from JAX (jax.devices()) and the mesh section"),
    Ignored("trainer.device", "JAX picks the platform (JAX_PLATFORMS)"),
    Ignored("trainer.default_hdfs_dir", "no HDFS: checkpoints go to trainer.default_local_dir"),
    Ignored("trainer.del_local_ckpt_after_load", "local checkpoints are kept"),
    Ignored("trainer.remove_previous_ckpt_in_save", "use trainer.max_actor_ckpt_to_keep"),
    Ignored("trainer.ray_wait_register_center_timeout", "no Ray"),
    Ignored("trainer.balance_batch", "no per-rank length balancing: batches are padded to static shapes"),
    Ignored("trainer.profile_steps", "use the JAX profiler"),
    Ignored("trainer.profile_continuous_steps", "use the JAX profiler"),
    Ignored("trainer.npu_profile", "use the JAX profiler"),
    Ignored("trainer.use_legacy_worker_impl", "no Ray workers"),
    Ignored("trainer.esi_redundant_time", "no elastic-instance preemption handling; checkpoints resume instead"),
    Ignored("trainer.rollout_data_dir", "dumping rollouts is not implemented (see trainer.log_val_generations)", _off),
    Ignored("trainer.validation_data_dir", "dumping validation generations is not implemented", _off),
)


def find_ignored(path: str) -> Ignored | None:
    """The :class:`Ignored` entry matching dotted ``path``, if any; an exact entry wins over a wildcard one."""
    for entry in IGNORED:
        if entry.pattern == path:
            return entry
    for entry in IGNORED:
        if fnmatch.fnmatchcase(path, entry.pattern):
            return entry
    return None
