"""Rollout throughput: rlhf_jax's sampler vs ``transformers`` ``generate`` on SmolLM2-135M-Instruct, CPU, float32.

Both decode the same chat-templated prompts for exactly ``--new-tokens`` tokens
(EOS ignored), greedily by default (``--sample`` draws at temperature 1 on both
sides). The same run measures this machine's matmul FLOP/s and memory
bandwidth and reports each result as a fraction of the decode roofline:

    roofline tokens/s = min(batch * bandwidth / (weight bytes + KV bytes read per step),
                            FLOP/s / FLOPs per token)

with the KV cache read at its mean live length (prompt + new_tokens / 2).

    python benchmarks/rollout.py [--batches 16 64] [--new-tokens 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlhf_jax.models import from_pretrained  # noqa: E402
from rlhf_jax.rollout import Sampler, SamplingParams, bucket_length, left_pad, rollout_key  # noqa: E402
from rlhf_jax.tools import smollm2  # noqa: E402

TOPICS = ["the moon", "rivers", "prime numbers", "bread", "volcanoes", "chess", "owls", "the printing press"]
TASKS = [
    "Explain {t} to a child in two sentences.",
    "Write a short poem about {t}.",
    "Give three facts about {t}.",
    "What is the most surprising thing about {t}?",
    "Summarise the history of {t} briefly.",
    "Why do people find {t} interesting?",
    "Describe {t} in one paragraph.",
    "List some questions a student might ask about {t}.",
]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    texts = [task.format(t=topic) for topic in TOPICS for task in TASKS][:count]
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for t in texts
    ]


def timed(fn, repeats: int) -> float:
    """Best wall time of ``repeats`` runs (fn must block until its result is ready)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine() -> dict:
    """Matmul FLOP/s (jax, float32) and memory read bandwidth (jax reduction over 512 MiB)."""
    a = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (2048, 2048), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, b).block_until_ready()
    t_mm = timed(lambda: mm(a, b).block_until_ready(), 5)
    big = jnp.ones((128 * 1024 * 1024,), jnp.float32)  # 512 MiB
    red = jax.jit(jnp.sum)
    red(big).block_until_ready()
    t_bw = timed(lambda: red(big).block_until_ready(), 5)
    big_np = np.ones((128 * 1024 * 1024,), np.float32)
    t_np = timed(lambda: big_np.sum(), 3)
    return {
        "matmul_flops": 2 * 2048**3 / t_mm,
        "bandwidth_bytes_per_s": max(big.nbytes / t_bw, big_np.nbytes / t_np),
    }


def roofline(cfg, param_bytes: int, batch: int, prompt_len: float, new_tokens: int, machine: dict) -> dict:
    ctx = prompt_len + new_tokens / 2
    kv_bytes = cfg.num_hidden_layers * 2 * batch * ctx * cfg.num_key_value_heads * cfg.head_dim * 4
    mem_bound = batch * machine["bandwidth_bytes_per_s"] / (param_bytes + kv_bytes)
    matmul_params = param_bytes / 4 - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    flops_per_token = 2 * matmul_params + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * ctx
    compute_bound = machine["matmul_flops"] / flops_per_token
    return {"memory_bound_tok_s": mem_bound, "compute_bound_tok_s": compute_bound, "roofline_tok_s": min(mem_bound, compute_bound)}


def run_ours(model, prompts, new_tokens: int, sample: bool, repeats: int) -> tuple[float, list[list[int]]]:
    graphdef, state = nnx.split(model)
    sampler = Sampler(graphdef)
    params = SamplingParams(
        max_new_tokens=new_tokens, temperature=1.0, do_sample=sample, ignore_eos=True, pad_token_id=2, eos_token_ids=(2,)
    )
    ids, mask = left_pad(prompts, bucket_length(max(len(p) for p in prompts)), len(prompts), 2)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)

    def once():
        out = sampler.generate(state, ids, mask, params, rollout_key(0))
        jax.block_until_ready(out)
        return out

    once()  # compile
    seconds = timed(once, repeats)
    return len(prompts) * new_tokens / seconds, np.asarray(once().responses).tolist()


def run_transformers(path, prompts, new_tokens: int, sample: bool, threads: int) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=2,
                  do_sample=sample, temperature=1.0 if sample else None, top_k=0 if sample else None, top_p=1.0 if sample else None)
    with torch.no_grad():
        model.generate(ids[:, :], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        seconds = time.perf_counter() - start
    return len(prompts) * new_tokens / seconds, out[:, width:].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sample", action="store_true", help="temperature-1 sampling instead of greedy")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of our sampler (best is kept)")
    ap.add_argument("--torch-threads", type=int, nargs="+", default=[1, 2], help="torch thread counts to try; best kept")
    ap.add_argument("--json", default="benchmarks/results/rollout.json")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    load = os.getloadavg()
    path = smollm2.ensure(verbose=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = from_pretrained(path, dtype=jnp.float32)
    cfg = model.config
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    machine = measure_machine()
    rows = []
    for batch in args.batches:
        prompts = chat_prompts(tokenizer, batch)
        ours, our_tokens = run_ours(model, prompts, args.new_tokens, args.sample, args.repeats)
        # transformers gets its best torch thread count (oversubscribed torch threads stall on a shared machine)
        hf_runs = {t: run_transformers(path, prompts, args.new_tokens, args.sample, t) for t in args.torch_threads}
        best_threads = max(hf_runs, key=lambda t: hf_runs[t][0])
        theirs, their_tokens = hf_runs[best_threads]
        same = sum(a == b for a, b in zip(our_tokens, their_tokens)) if not args.sample else None
        mean_prompt = float(np.mean([len(p) for p in prompts]))
        roof = roofline(cfg, param_bytes, batch, mean_prompt, args.new_tokens, machine)
        rows.append({
            "batch": batch, "new_tokens": args.new_tokens, "mean_prompt_tokens": mean_prompt,
            "rlhf_jax_tok_s": ours, "transformers_tok_s": theirs, "ratio": ours / theirs,
            "rlhf_jax_roofline_fraction": ours / roof["roofline_tok_s"],
            "transformers_roofline_fraction": theirs / roof["roofline_tok_s"],
            "identical_greedy_rows": same, "transformers_tok_s_by_threads": {t: r[0] for t, r in hf_runs.items()},
            "torch_threads": best_threads, **roof,
        })
    result = {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "mode": "sample" if args.sample else "greedy",
        "devices": str(jax.devices()[0]), "cpu_count": os.cpu_count(), "load_avg_before": load,
        "load_avg_after": os.getloadavg(), "param_bytes": param_bytes, **machine, "rows": rows,
    }
    print(f"machine: matmul {machine['matmul_flops'] / 1e9:.1f} GFLOP/s, bandwidth {machine['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"load avg before {load[0]:.2f} after {result['load_avg_after'][0]:.2f}")
    head = f"{'batch':>5} {'rlhf_jax tok/s':>15} {'transformers tok/s':>19} {'ratio':>6} {'roofline tok/s':>15} {'ours/roof':>9} {'hf/roof':>8} {'same rows':>9}"
    print(head)
    for r in rows:
        print(f"{r['batch']:>5} {r['rlhf_jax_tok_s']:>15.1f} {r['transformers_tok_s']:>19.1f} {r['ratio']:>6.2f} "
              f"{r['roofline_tok_s']:>15.1f} {r['rlhf_jax_roofline_fraction']:>9.2f} {r['transformers_roofline_fraction']:>8.2f} "
              f"{'-' if r['identical_greedy_rows'] is None else r['identical_greedy_rows']:>9}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
