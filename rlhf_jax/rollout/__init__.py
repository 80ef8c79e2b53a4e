"""Sampler: prefill + continuous-batching decode in one jitted loop, n samples per prompt, sampling processors.

High level: ``generate(model, prompt_ids, max_new_tokens=...)`` on lists of token ids.
Trainer level: ``Sampler`` (compiled programs keyed by static shapes) turns
left-padded (B, P) prompt arrays into a ``RolloutBatch`` with ``SamplingParams``
built by ``SamplingParams.from_config(cfg.actor_rollout_ref.rollout)``.
Drivers: ``generation`` samples a prompt batch for the trainer and ``python -m rlhf_jax.generate``;
``dynamic_sampling`` keeps the prompt groups whose scores vary (DAPO).
"""

from rlhf_jax.rollout.api import GenerateOutput, generate, generate_with_params, sampler_for
from rlhf_jax.rollout.buckets import bucket_batch, bucket_length, left_pad
from rlhf_jax.rollout.decode import DecodeStats, RolloutBatch, rollout, rollout_with_stats
from rlhf_jax.rollout.params import DEFAULT_PROCESSORS, SamplingParams, eos_token_ids_from_dir
from rlhf_jax.rollout.prefill import PromptCache, prefill_prompts
from rlhf_jax.rollout.processors import PROCESSORS, Candidates, apply_processors, register_processor
from rlhf_jax.rollout.sampler import Sampler
from rlhf_jax.rollout.sampling import draw, inverse_cdf, rollout_key, sample_step, token_logprobs
from rlhf_jax.rollout.scheduler import num_slots

__all__ = [
    "DEFAULT_PROCESSORS",
    "PROCESSORS",
    "PromptCache",
    "Candidates",
    "DecodeStats",
    "GenerateOutput",
    "RolloutBatch",
    "Sampler",
    "SamplingParams",
    "apply_processors",
    "bucket_batch",
    "bucket_length",
    "draw",
    "eos_token_ids_from_dir",
    "generate",
    "generate_with_params",
    "inverse_cdf",
    "left_pad",
    "num_slots",
    "prefill_prompts",
    "register_processor",
    "rollout",
    "rollout_key",
    "rollout_with_stats",
    "sample_step",
    "sampler_for",
    "token_logprobs",
]
