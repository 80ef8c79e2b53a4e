"""Rollout throughput: rlhf_jax's sampler vs ``transformers`` ``generate`` on SmolLM2-135M-Instruct, CPU, float32.

RL-style sampling on both sides, in the same run: ``--prompts`` chat-templated
prompts x ``--n`` samples each, temperature 1 (no top-k/top-p), stop at any of
the checkpoint's EOS ids, at most ``--new-tokens`` new tokens (one table row
per value and prompt set). Two prompt sets (``--prompt-set``): ``chat``,
open-ended requests whose answers are long (most of the 128-token budget), and
``rl``, the GRPO step benchmark's arithmetic questions, whose answers have the
long tail of RL sampling (~40 tokens mean, a few cut at the limit). What
counts is useful tokens per second: the tokens of each response up to and
including its EOS. ``transformers`` decodes every row until the last one
ends; our sampler refills finished decode slots and shrinks its batch for the
tail, so it also reports the decode steps x slots it executed against the
static loop's (all N rows until the longest response ends). The same run
measures float32 matmul FLOP/s and reports useful tokens/s as a fraction of
the compute roofline (FLOP/s / FLOPs per token).

    python benchmarks/rollout.py                                  # both prompt sets x 128 and 512 new tokens
    python benchmarks/rollout.py --slots auto 16 32               # also fewer slots with refills
    python benchmarks/rollout.py --prompts 2 --n 2 --new-tokens 16 --torch-threads 1 --repeats 1 --json ''
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __name__ == "__main__":  # as rlhf_jax.main does; transformers, in this process, gets the same malloc
    from rlhf_jax.hostmem import reexec_with_hugepages

    reexec_with_hugepages()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlhf_jax.models import from_pretrained  # noqa: E402
from rlhf_jax.rollout import Sampler, SamplingParams, bucket_length, eos_token_ids_from_dir, left_pad, rollout_key  # noqa: E402
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


def templated(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as one user turn in the model's chat template, ready for the assistant's answer."""
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"])
        for t in texts
    ]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    return templated(tokenizer, [task.format(t=topic) for topic in TOPICS for task in TASKS][:count])


def rl_prompts(tokenizer, count: int) -> list[list[int]]:
    """The GRPO step benchmark's questions (``What is a+b? Answer with just the number.``), chat-templated: short
    answers with the long tail of RL sampling (SmolLM2 at temperature 1: ~40 tokens mean, a few cut at 128)."""
    from grpo_step import make_prompts

    return templated(tokenizer, [r["question"] for r in make_prompts(1)[:count]])


PROMPT_SETS = {"chat": chat_prompts, "rl": rl_prompts}


def useful_lengths(rows: list[list[int]], eos: tuple[int, ...]) -> np.ndarray:
    """Tokens of each response up to and including its first EOS (all of them when there is none)."""
    return np.array([next((i + 1 for i, t in enumerate(r) if t in eos), len(r)) for r in rows])


def measure_matmul_flops() -> float:
    a = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        mm(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best


def flops_per_token(cfg, param_bytes: int, context: float) -> float:
    """Matmul FLOPs of one decoded token (weights, logits and attention over ``context`` keys).

    The input embedding is a lookup; only an untied model has a separate output matrix to leave out of it.
    """
    matmul_params = param_bytes / 4 - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    return 2 * matmul_params + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context


def run_ours(model, prompts, n: int, new_tokens: int, eos, pad: int, slots: int | None, repeats: int) -> dict:
    graphdef, state = nnx.split(model)
    sampler = Sampler(graphdef, max_positions=model.config.max_position_embeddings)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=n, eos_token_ids=eos, pad_token_id=pad,
                            max_num_seqs=slots)
    ids, mask = left_pad(prompts, bucket_length(max(len(p) for p in prompts)), len(prompts), pad)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)

    def once():
        out = sampler.generate_with_stats(state, ids, mask, params, rollout_key(0))
        return jax.block_until_ready(out)

    start = time.perf_counter()
    once()
    compile_s = time.perf_counter() - start
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = once()
        best = min(best, time.perf_counter() - start)
    batch, stats = result
    lengths = np.asarray(batch.response_mask).sum(axis=1)
    return {
        "seconds": best, "first_call_seconds": compile_s, "lengths": lengths,
        "slot_steps": stats.slot_steps(), "static_slot_steps": int(len(lengths) * (lengths.max() - 1)),
        "loops": [[m, int(s)] for m, s in zip(stats.slots, jax.device_get(stats.steps))],
    }


def run_transformers(path, prompts, n: int, new_tokens: int, eos, pad: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                  eos_token_id=list(eos), pad_token_id=pad)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, **kwargs)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "lengths": useful_lengths(out[:, width:].tolist(), tuple(eos))}


def summary(run: dict) -> dict:
    lengths = run["lengths"]
    out = {k: v for k, v in run.items() if k != "lengths"}
    out.update(useful_tokens=int(lengths.sum()), useful_tok_s=float(lengths.sum() / run["seconds"]),
               mean_length=float(lengths.mean()), max_length=int(lengths.max()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-set", nargs="+", choices=sorted(PROMPT_SETS), default=["chat", "rl"],
                    help="chat: open-ended requests (long answers); rl: the GRPO step's arithmetic questions")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--slots", nargs="+", default=["auto"], help="decode slot counts to run ('auto' = the default rule)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of our sampler (best is kept)")
    ap.add_argument("--torch-threads", type=int, nargs="+", default=[1, 2], help="torch thread counts to try; best kept")
    ap.add_argument("--json", default="benchmarks/results/rollout.json")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    load = os.getloadavg()
    path = smollm2.ensure(verbose=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = eos_token_ids_from_dir(path, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    model = from_pretrained(path, dtype=jnp.float32)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    matmul_flops = measure_matmul_flops()
    rows = []
    for prompt_set in args.prompt_set:
        prompts = PROMPT_SETS[prompt_set](tokenizer, args.prompts)
        mean_prompt = float(np.mean([len(p) for p in prompts]))
        for new_tokens in args.new_tokens:
            # transformers gets its best torch thread count (oversubscribed torch threads stall on a shared machine)
            hf_runs = {t: summary(run_transformers(path, prompts, args.n, new_tokens, eos, pad, t))
                       for t in args.torch_threads}
            best_threads = max(hf_runs, key=lambda t: hf_runs[t]["useful_tok_s"])
            theirs = hf_runs[best_threads]
            for slots in args.slots:
                ours = summary(run_ours(model, prompts, args.n, new_tokens, eos, pad,
                                        None if slots == "auto" else int(slots), args.repeats))
                context = mean_prompt + ours["mean_length"] / 2
                roofline = matmul_flops / flops_per_token(model.config, param_bytes, context)
                rows.append({
                    "prompt_set": prompt_set, "new_tokens": new_tokens, "slots": slots, "samples": args.prompts * args.n,
                    "mean_prompt_tokens": mean_prompt,
                    "rlhf_jax": ours, "transformers": theirs, "ratio": ours["useful_tok_s"] / theirs["useful_tok_s"],
                    "compute_roofline_tok_s": roofline, "rlhf_jax_roofline_fraction": ours["useful_tok_s"] / roofline,
                    "transformers_tok_s_by_threads": {t: r["useful_tok_s"] for t, r in hf_runs.items()},
                    "torch_threads": best_threads,
                })
    result = {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "sampling": "temperature 1.0, stop at EOS",
        "devices": str(jax.devices()[0]), "cpu_count": os.cpu_count(), "load_avg_before": load,
        "load_avg_after": os.getloadavg(), "param_bytes": param_bytes, "matmul_flops": matmul_flops, "rows": rows,
    }
    print(f"matmul {matmul_flops / 1e9:.1f} GFLOP/s; load avg before {load[0]:.2f} after {result['load_avg_after'][0]:.2f}")
    print(f"{'prompts':>7} {'new':>4} {'slots':>5} {'ours tok/s':>10} {'hf tok/s':>9} {'ratio':>6} "
          f"{'ours len mean/max':>17} "
          f"{'hf len mean/max':>15} {'slot-steps ours/static':>22} {'ours/roof':>9}")
    for r in rows:
        o, h = r["rlhf_jax"], r["transformers"]
        print(f"{r['prompt_set']:>7} {r['new_tokens']:>4} {r['slots']:>5} {o['useful_tok_s']:>10.1f} "
              f"{h['useful_tok_s']:>9.1f} {r['ratio']:>6.2f} "
              f"{o['mean_length']:>11.1f}/{o['max_length']:<5} {h['mean_length']:>9.1f}/{h['max_length']:<5} "
              f"{o['slot_steps']:>11}/{o['static_slot_steps']:<10} {r['rlhf_jax_roofline_fraction']:>9.2f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
