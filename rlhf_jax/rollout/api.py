"""``generate``: sample from a model given prompts as Python lists of token ids.

Prompts are left-padded into bucketed shapes (see ``buckets``) and sampled by
a ``Sampler`` kept per model object, so repeated calls with prompts that fall
into the same buckets reuse one compiled program.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Iterable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlhf_jax.parallel.mesh import data_parallel_size
from rlhf_jax.rollout.buckets import bucket_batch, bucket_length, left_pad
from rlhf_jax.rollout.decode import RolloutBatch
from rlhf_jax.rollout.params import SamplingParams, as_token_ids
from rlhf_jax.rollout.sampler import Sampler, mesh_of
from rlhf_jax.rollout.sampling import rollout_key

_SAMPLERS: "weakref.WeakKeyDictionary[nnx.Module, Sampler]" = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class GenerateOutput:
    """Responses in prompt-major order (the n samples of prompt 0 first), without padding."""

    tokens: list[list[int]]  # EOS included when produced
    logprobs: list[list[float]]  # log_softmax(logits / temperature) of each token
    finished: list[bool]  # ended with EOS (False: stopped at max_new_tokens)
    batch: RolloutBatch  # the padded device arrays, filler rows included


def sampler_for(model: nnx.Module, mesh: Mesh | None = None) -> Sampler:
    """The cached ``Sampler`` of ``model`` (one per model object and mesh)."""
    sampler = _SAMPLERS.get(model)
    if sampler is None or sampler.mesh != mesh:
        sampler = Sampler.for_model(model, mesh=mesh)
        _SAMPLERS[model] = sampler
    return sampler


def default_pad_id(model: nnx.Module, eos_token_ids: Sequence[int]) -> int:
    pad = model.config.pad_token_id
    if pad is not None:
        return int(pad)
    return int(eos_token_ids[0]) if eos_token_ids else 0


def generate_with_params(
    model: nnx.Module,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    key: jax.Array | None = None,
    mesh: Mesh | None = None,
) -> GenerateOutput:
    """Sample ``params.n`` responses per prompt; prompts may have different lengths."""
    sampler = sampler_for(model, mesh)
    _, state = nnx.split(model)
    run_mesh = mesh if mesh is not None else mesh_of(state)
    prompts = [list(p) for p in prompt_ids]
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    room = model.config.max_position_embeddings - params.max_new_tokens  # longest prompt that still fits
    length = bucket_length(max(len(p) for p in prompts), maximum=room)
    batch = bucket_batch(len(prompts), multiple=data_parallel_size(run_mesh))
    ids, mask = left_pad(prompts, length, batch, params.pad_token_id)
    out = sampler.generate(state, ids, mask, params, key)
    real = len(prompts) * params.n
    responses = np.asarray(out.responses)[:real]
    lengths = np.asarray(out.response_mask).sum(axis=1)[:real]
    logprobs = np.asarray(out.logprobs)[:real]
    return GenerateOutput(
        tokens=[responses[i, : lengths[i]].tolist() for i in range(real)],
        logprobs=[logprobs[i, : lengths[i]].tolist() for i in range(real)],
        finished=np.asarray(out.finished)[:real].tolist(),
        batch=out,
    )


def generate(
    model: nnx.Module,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    n: int = 1,
    eos_token_ids: Iterable[int] | None = None,
    seed: int = 0,
    ignore_eos: bool = False,
    do_sample: bool = True,
    pad_token_id: int | None = None,
    max_num_seqs: int | None = None,
    mesh: Mesh | None = None,
) -> GenerateOutput:
    """Sample from ``model`` for prompts given as lists of token ids.

    ``eos_token_ids`` None uses the checkpoint's ``eos_token_id`` (config.json);
    pass ``()`` to never stop early. ``temperature=0`` or ``do_sample=False``
    decodes greedily. ``max_num_seqs`` caps the decode slots (None: every
    sample at once, up to 256). Same seed, same tokens, whatever the slots.
    """
    if eos_token_ids is None:
        eos_token_ids = as_token_ids(model.config.hf_config.get("eos_token_id"))
    eos = tuple(int(e) for e in eos_token_ids)
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        n=n,
        do_sample=do_sample,
        ignore_eos=ignore_eos,
        seed=seed,
        eos_token_ids=eos,
        pad_token_id=default_pad_id(model, eos) if pad_token_id is None else pad_token_id,
        max_num_seqs=max_num_seqs,
    )
    return generate_with_params(model, prompt_ids, params, key=rollout_key(seed), mesh=mesh)
