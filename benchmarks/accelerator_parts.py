"""The measurements of ``benchmarks/accelerator.py``, one function per section; each returns plain dicts.

Every timed call blocks on its outputs (``jax.block_until_ready``; torch: ``cuda.synchronize``), the first call
of a program (its compilation) is timed apart, and only the package's own model, ``Role``, sampler, packing and
step code runs on the JAX side. The modules imported here need jax, flax, optax, numpy, transformers and torch
only (no config, data-loader or logger dependencies).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

BF16, F32 = jnp.bfloat16, jnp.float32


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """(first call's seconds, best of ``repeats`` further calls (the first call's when 0), last output); every call
    waits for its outputs."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = best = time.perf_counter() - start
    for i in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = time.perf_counter() - start if i == 0 else min(best, time.perf_counter() - start)
    return first, best, out


def peak_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def torch_device() -> str:
    """The torch device on the accelerator JAX uses (CUDA for a GPU; the host CPU otherwise)."""
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def torch_sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- model arithmetic
def matmul_params(hf: dict) -> int:
    """Weights that take part in a matmul per token (every projection and the output head; not the lookup)."""
    E, F, L, V = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["vocab_size"]
    D = E // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * D, hf["num_key_value_heads"] * D
    return L * (E * (q + 2 * kv) + q * E + 3 * E * F) + E * V


def train_flops_per_token(hf: dict, context: float) -> float:
    """Forward + backward model FLOPs of one trained token: 6 per matmul weight, and attention's two matmuls over
    ``context`` keys (the mean causal context of the packed sequences) forward and twice backward."""
    attention = 4 * hf["num_hidden_layers"] * hf["num_attention_heads"] * (hf["hidden_size"] // hf["num_attention_heads"])
    return 6 * matmul_params(hf) + 3 * attention * context


def decode_step_bytes(hf: dict, slots: int, cache_len: int, weight_bytes: int, cache_itemsize: int = 2) -> int:
    """Bytes one decode step must read at least: every weight once and the KV cache the dense path reads
    (every slot's whole cache, ``cache_len`` columns)."""
    D = hf["hidden_size"] // hf["num_attention_heads"]
    cache = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * D * cache_len * cache_itemsize
    return weight_bytes + slots * cache


def random_model(hf: dict, *, dtype, param_dtype, remat: str = "none", mesh=None, seed: int = 0):
    from rlhf_jax.models import from_hf_dict, init_model

    return init_model(from_hf_dict(hf, dtype=dtype, param_dtype=param_dtype, remat=remat), mesh=mesh, seed=seed)


def state_bytes(state: Any) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(state)))


# ----------------------------------------------------------------------------- (a) logits parity
def logits_parity(hf: dict, tokens: int, rows: int = 2) -> list[dict]:
    """Our logits against transformers' on the same random checkpoint and device, float32 and bfloat16.

    float32 runs at 'highest' matmul precision on both sides (no TF32), so it checks the model; bfloat16 runs both
    sides in bf16 weights and compute, so differences are bf16 roundings of the logits.
    """
    import torch
    import transformers

    from rlhf_jax.models import from_pretrained

    device = torch_device()
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    ids = np.random.default_rng(0).integers(0, hf["vocab_size"], (rows, tokens)).astype(np.int32)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        transformers.Qwen2ForCausalLM(config).save_pretrained(tmp)
        for name, jdt, tdt in (("float32", F32, torch.float32), ("bfloat16", BF16, torch.bfloat16)):
            theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=tdt).to(device).eval()
            with torch.no_grad():
                prev = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = False
                theirs = theirs_model(torch.as_tensor(ids, dtype=torch.long, device=device)).logits.float().cpu().numpy()
                torch.backends.cuda.matmul.allow_tf32 = prev
            ours_model = from_pretrained(tmp, dtype=jdt, param_dtype=jdt)
            with jax.default_matmul_precision("highest" if name == "float32" else "default"):
                ours = np.asarray(jax.jit(lambda m, x: m(x))(ours_model, jnp.asarray(ids)), np.float32)
            diff = np.abs(ours - theirs)
            scale = float(np.abs(theirs).max())
            # float32: a few float32 roundings of each logit; bf16: a few bf16 roundings (2^-8 relative) of the
            # largest logit, the residual stream carrying that much error into every logit
            tolerance = 1e-4 * max(scale, 1.0) if name == "float32" else 4 * 2.0**-8 * max(scale, 1.0)
            out.append({"dtype": name, "torch_device": device, "max_abs_diff": float(diff.max()),
                        "mean_abs_diff": float(diff.mean()), "max_abs_logit": scale, "tolerance": tolerance,
                        "within_tolerance": bool(diff.max() <= tolerance),
                        "argmax_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).mean())})
            del theirs_model
    return out


# ----------------------------------------------------------------------------- (b) the update
@dataclasses.dataclass(frozen=True)
class Rollout:
    """A synthetic rollout batch in the sampler's layout: left-padded prompts, responses from column 0."""

    prompts: np.ndarray
    prompt_mask: np.ndarray
    responses: np.ndarray
    response_mask: np.ndarray


def synthetic_rollout(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> Rollout:
    rng = np.random.default_rng(seed)
    return Rollout(rng.integers(0, vocab, (n, prompt_len)).astype(np.int32), np.ones((n, prompt_len), np.int32),
                   rng.integers(0, vocab, (n, response_len)).astype(np.int32), np.ones((n, response_len), np.int32))


def packed_micros(batch: Rollout, row_len: int, rows_per_micro: int, mesh) -> tuple[list[dict], Any]:
    """The trainer's packed micro-batches of ``batch`` (``rlhf_jax.batch.pack_batch``), placed on ``mesh``."""
    from rlhf_jax.batch import pack_batch
    from rlhf_jax.parallel.hosts import to_global

    packed = pack_batch(batch.prompts, batch.prompt_mask, batch.responses, batch.response_mask, dp=1, row_len=row_len,
                        max_rows_per_micro=rows_per_micro, share_prompts=False)
    return [{k: to_global(mesh, v) for k, v in packed.micro(i).items()} for i in range(packed.num_micro)], packed


def actor_grid(batch: Rollout, old_log_probs=None, advantages=None, seed: int = 1):
    """The update's (rows, R) arrays as a ``TrainBatch``: response mask, old log-probs and advantages (random where
    not given)."""
    from rlhf_jax.types import TrainBatch

    rng = np.random.default_rng(seed)
    shape = batch.responses.shape
    return TrainBatch(response_mask=jnp.asarray(batch.response_mask),
                      old_log_probs=jnp.asarray(old_log_probs if old_log_probs is not None else
                                                -rng.uniform(0.5, 3.0, shape).astype(np.float32)),
                      advantages=jnp.asarray(advantages if advantages is not None else
                                             rng.standard_normal(shape).astype(np.float32)))


def actor_loss(**changes):
    """The actor loss (``train/losses.actor``) with the key table's defaults (``config/keys_policy.py``: no config
    file is read here) and ``changes``."""
    from rlhf_jax.config.keys_policy import KEYS
    from rlhf_jax.train import losses
    from rlhf_jax.train.steps import ActorLossSpec

    d = {k.path[len("actor_rollout_ref.actor."):]: k.default for k in KEYS if k.path.startswith("actor_rollout_ref.actor.")}
    settings = dict(loss_mode=d["policy_loss.loss_mode"], loss_agg_mode=d["loss_agg_mode"],
                    clip_ratio_low=d["clip_ratio"], clip_ratio_high=d["clip_ratio"], clip_ratio_c=d["clip_ratio_c"],
                    entropy_coeff=d["entropy_coeff"], use_kl_loss=d["use_kl_loss"], kl_loss_coef=d["kl_loss_coef"],
                    kl_loss_type=d["kl_loss_type"], temperature=1.0, use_old_log_probs=True,
                    norm_constant=d["loss_scale_factor"])
    return losses.actor(ActorLossSpec(**{**settings, **changes}))


def update_throughput(hf: dict, remat: bool, *, sequences: int, prompt_len: int, response_len: int, row_len: int,
                      rows_per_micro: int, repeats: int, predict: Callable) -> dict:
    """One actor update (the trainer's packed path: ``Role.update_packed``) of a random model in bf16 compute over
    float32 weights and AdamW state: tokens/s, MFU against the chip's peak, and the plan's roofline."""
    import optax

    from rlhf_jax.parallel import single_device_mesh
    from rlhf_jax.train.engine import Role

    mesh = single_device_mesh()
    role = Role(random_model(hf, dtype=BF16, param_dtype=F32, remat="full" if remat else "none", mesh=mesh), mesh,
                optax.adamw(1e-6))
    batch = synthetic_rollout(sequences, prompt_len, response_len, hf["vocab_size"])
    micros, packed = packed_micros(batch, row_len, rows_per_micro, mesh)
    grid = actor_grid(batch)
    loss, key = actor_loss(), jax.random.key(0)
    first, best, _ = timed(lambda: (role.update_packed(loss, micros, grid, dp=1, rng=key), role.params), repeats)
    tokens = packed.real_tokens
    flops = train_flops_per_token(hf, (prompt_len + response_len + 1) / 2) * tokens
    micro = micros[0]
    program = role.packed_grads_program(loss, micro["input_ids"].shape, micro["logit_positions"].shape[0], grid, 1)
    out = {"tokens": int(tokens), "micro_batches": len(micros), "row_len": row_len, "rows_per_micro": rows_per_micro,
           "first_call_s": first, "seconds": best, "tokens_per_s": tokens / best, "model_flops": flops,
           "flops_per_s": flops / best, "process_peak_memory_bytes": peak_memory_bytes(),  # since the process began
           "plan": predict("update_actor", program, model_flops=flops / len(micros), calls=len(micros))}
    return out  # the role's arrays go with this frame, before the next model is built


# ----------------------------------------------------------------------------- (c) decode
def sampler_decode(hf: dict, slots: int, *, prompt_len: int, new_tokens: int, repeats: int, predict: Callable) -> dict:
    """``slots`` sequences decoded at once to ``new_tokens`` each (ignore_eos: every slot runs to the end), bf16
    weights and compute, by the package's ``Sampler``."""
    from flax import nnx

    from rlhf_jax.rollout import Sampler, SamplingParams, rollout_key

    model = random_model(hf, dtype=BF16, param_dtype=BF16)
    graphdef, state = nnx.split(model)
    sampler = Sampler(graphdef, max_positions=hf["max_position_embeddings"])
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=1, ignore_eos=True, max_num_seqs=slots)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, hf["vocab_size"], (slots, prompt_len)), jnp.int32)
    mask = jnp.ones_like(ids)
    first, best, (batch, _) = timed(lambda: sampler.generate_with_stats(state, ids, mask, params, rollout_key(0)),
                                    repeats)
    generated = int(np.asarray(batch.response_mask).sum())
    weight_bytes = state_bytes(state)
    cache_len = sampler_cache_len(prompt_len, new_tokens)
    step_bytes = decode_step_bytes(hf, slots, cache_len, weight_bytes)
    (program,) = sampler._compiled.values()
    flops = 2 * matmul_params(hf) * generated
    return {"slots": slots, "new_tokens": new_tokens, "prompt_len": prompt_len, "generated_tokens": generated,
            "first_call_s": first, "seconds": best, "tokens_per_s": generated / best, "weight_bytes": weight_bytes,
            "decode_step_bytes": step_bytes,
            "plan": predict("sampler", program, model_flops=flops, model_bytes=step_bytes * new_tokens, looped=True)}


def sampler_cache_len(prompt_len: int, new_tokens: int) -> int:
    """Columns of the sampler's KV cache for this shape (prompt bucket + response), as the dense decode reads."""
    from rlhf_jax.rollout import bucket_length

    return bucket_length(prompt_len) + new_tokens


def transformers_generate(hf: dict, slots: int, *, prompt_len: int, new_tokens: int) -> dict:
    """transformers ``generate`` of a random model of the same shape, bf16, on the same device: ``slots`` rows to
    exactly ``new_tokens`` (min = max new tokens), sampled at temperature 1."""
    import torch
    import transformers

    device = torch_device()
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    with torch.device(device):  # initialised where it runs
        model = transformers.Qwen2ForCausalLM(config).to(dtype=torch.bfloat16).eval()
    ids = torch.as_tensor(np.random.default_rng(2).integers(0, hf["vocab_size"], (slots, prompt_len)), device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        torch_sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        torch_sync(device)
        seconds = time.perf_counter() - start
    generated = int(out[:, prompt_len:].numel())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"slots": slots, "generated_tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds,
            "torch_device": device}
