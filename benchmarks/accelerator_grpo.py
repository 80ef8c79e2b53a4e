"""Section (d) of ``benchmarks/accelerator.py``: one GRPO step of a random model, stage by stage.

The step runs the trainer's stages with the package's parts (``Sampler`` over a bf16 copy of the actor's weights,
``pack_batch`` micro-batches, ``Role.log_probs_packed`` for the old and reference log-probs, ``steps.advantage_stage``
for GRPO's advantages, ``Role.update_packed`` with the k3 KL loss), as ``rlhf_jax.train.trainer`` strings them
together; the trainer itself is not used because it needs the config and data-loader dependencies
(ml_collections, grain), which an accelerator machine may lack. Each stage's timer waits for its outputs.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.accelerator_parts import (BF16, F32, Rollout, actor_loss, decode_step_bytes, matmul_params, packed_micros,
                                         random_model, sampler_cache_len, state_bytes, train_flops_per_token)

STAGES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor")


def toy_scores(responses: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A rule-based score per response: the fraction of its tokens with an even id (varies within a group)."""
    return ((responses % 2 == 0) * mask).sum(1) / np.maximum(mask.sum(1), 1)


def on_last_token(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    out = np.zeros(mask.shape, np.float32)
    out[np.arange(len(scores)), np.maximum(mask.sum(1) - 1, 0)] = scores
    return out


def grpo_step(hf: dict, *, prompts: int, n: int, prompt_len: int, new_tokens: int, row_len: int, rows_per_micro: int,
              predict: Callable) -> dict:
    """Two GRPO steps (the first compiles); the second's stage times, the update's tokens/s and the plan's
    prediction per stage (the programs each stage ran, at the calls it made)."""
    import optax

    from rlhf_jax.parallel import single_device_mesh
    from rlhf_jax.rollout import Sampler, SamplingParams, rollout_key
    from rlhf_jax.rollout.sampler import cast_floating
    from rlhf_jax.train.engine import Role
    from rlhf_jax.train.steps import advantage_stage
    from rlhf_jax.types import TrainBatch

    mesh = single_device_mesh()
    actor = Role(random_model(hf, dtype=BF16, param_dtype=F32, mesh=mesh), mesh, optax.adamw(1e-6))
    ref = Role(random_model(hf, dtype=BF16, param_dtype=F32, mesh=mesh), mesh)  # same seed: the same weights
    sampler = Sampler(actor.graphdef, max_positions=hf["max_position_embeddings"])
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=n, pad_token_id=0)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, hf["vocab_size"], (prompts, prompt_len)), jnp.int32)
    loss = actor_loss(use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl")
    advantages = jax.jit(functools.partial(advantage_stage, estimator="grpo", gamma=1.0, lam=1.0,
                                           norm_adv_by_std_in_grpo=True, use_kl_in_reward=False, kl_penalty="kl"))
    group_ids = jnp.asarray(np.repeat(np.arange(prompts), n).astype(np.int32))

    def step(index: int) -> tuple[dict, dict]:
        times: dict[str, float] = {}

        @contextlib.contextmanager
        def stage(name):
            start = time.perf_counter()
            yield
            times[name] = time.perf_counter() - start

        with stage("gen"):
            weights = cast_floating(actor.state(), "bfloat16")  # rollout.weight_dtype=bfloat16
            out = jax.block_until_ready(sampler.generate(weights, ids, jnp.ones_like(ids), sampling, rollout_key(0, index)))
            del weights
        host = Rollout(*(np.asarray(x) for x in (out.prompts, out.prompt_mask, out.responses, out.response_mask)))
        with stage("reward"):
            token_scores = jnp.asarray(on_last_token(toy_scores(host.responses, host.response_mask), host.response_mask))
        micros, packed = packed_micros(host, row_len, rows_per_micro, mesh)
        grid_shape = host.responses.shape
        with stage("old_log_prob"):
            old = jax.block_until_ready(actor.log_probs_packed(micros, grid_shape, dp=1, temperature=1.0))
        with stage("ref"):
            ref_lp = jax.block_until_ready(ref.log_probs_packed(micros, grid_shape, dp=1, temperature=1.0))
        mask = jnp.asarray(host.response_mask)
        with stage("adv"):
            _, adv, _, _ = jax.block_until_ready(advantages(token_scores, mask, group_ids, old, ref_lp, None,
                                                            jnp.float32(0.0)))
        grid = TrainBatch(response_mask=mask, old_log_probs=old, advantages=adv, ref_log_probs=ref_lp)
        with stage("update_actor"):
            metrics = actor.update_packed(loss, micros, grid, dp=1, rng=jax.random.key(index))
            jax.block_until_ready(actor.params)
        info = {"real_tokens": int(packed.real_tokens), "micro_batches": len(micros),
                "response_tokens": int(host.response_mask.sum()), "micro": micros[0], "grid": grid,
                "grad_norm": float(metrics["actor/grad_norm"]), "pg_loss": float(metrics["actor/pg_loss"])}
        return times, info

    first, _ = step(0)
    times, info = step(1)
    times["step"] = sum(times[s] for s in STAGES)
    micro, grid = info.pop("micro"), info.pop("grid")
    calls = info["micro_batches"]
    logits = micro["logit_positions"].shape[0]
    forward_flops = train_flops_per_token(hf, (prompt_len + new_tokens + 1) / 2) / 3 * info["real_tokens"]
    (sampler_program,) = sampler._compiled.values()
    plans = {
        "gen": predict("sampler", sampler_program, model_flops=2 * matmul_params(hf) * prompts * n * new_tokens,
                       model_bytes=new_tokens * decode_step_bytes(hf, prompts * n, sampler_cache_len(prompt_len, new_tokens),
                                                                  state_bytes(actor.params) // 2),
                       looped=True),
        "old_log_prob": predict("old_log_prob", actor.packed_forward_program(
            "logp", micro["input_ids"].shape, logits, grid.response_mask.shape, 1, temperature=1.0),
            model_flops=forward_flops / calls, calls=calls),
        "ref": predict("ref", ref.packed_forward_program(
            "logp", micro["input_ids"].shape, logits, grid.response_mask.shape, 1, temperature=1.0),
            model_flops=forward_flops / calls, calls=calls),
        "update_actor": predict("update_actor", actor.packed_grads_program(
            loss, micro["input_ids"].shape, logits, grid, 1),
            model_flops=3 * forward_flops / calls, calls=calls),
    }
    info["update_tokens_per_s"] = info["real_tokens"] / times["update_actor"]
    return {"prompts": prompts, "n": n, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "first_step_s": sum(first[s] for s in STAGES), "stages_s": times, "plan": plans, **info}
