"""LoRA rollouts: sampling with the adapters merged into the weights vs the low-rank path in every decode step.

Same model, same adapters (random, non-zero), same prompts, key and settings (``ignore_eos``, so both
sides decode the same number of steps); each side is compiled first and then timed over ``--repeats``
rollouts taken in turns (best of each). The base model without adapters is timed
alongside as the floor. The merged side includes the merge itself (one jitted pass over the adapted weights,
done once per rollout by the trainer). Prints one table and writes JSON.

    python benchmarks/lora_sampler.py                      # SmolLM2-135M-Instruct, rank 16, all-linear
    python benchmarks/lora_sampler.py --model builtin:tiny --new-tokens 16 --repeats 1 --json ''   # smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

if __name__ == "__main__":
    from rlhf_jax.hostmem import reexec_with_hugepages

    reexec_with_hugepages()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlhf_jax.models.hub import resolve_model_path  # noqa: E402
from rlhf_jax.models import from_pretrained, lora  # noqa: E402
from rlhf_jax.parallel import make_mesh  # noqa: E402
from rlhf_jax.rollout import Sampler, SamplingParams, rollout_key  # noqa: E402


def _with_random_adapters(model, spec, mesh, seed=0):
    model = lora.with_adapters(model, spec, mesh, seed=seed)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(state):
        if str(path[-1]).endswith(lora.SUFFIX_B):
            value = var.get_value()
            var = var.replace(value=jax.device_put((0.01 * rng.standard_normal(value.shape)).astype(value.dtype),
                                                   value.sharding))
        flat.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _best(fns: dict, repeats: int) -> dict:
    """Best time of each function; compiled first, then timed in turns so that load changes hit both alike."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reverse", action="store_true", help="time the sides in the reverse order in each round")
    parser.add_argument("--json", default="benchmarks/results/lora_sampler.json")
    args = parser.parse_args(argv)

    mesh = make_mesh(1, 1, 1)
    path = resolve_model_path(args.model)
    base = from_pretrained(path, mesh=mesh)
    spec = lora.LoraSpec(args.rank, 2.0 * args.rank, lora.PROJECTIONS)
    model = _with_random_adapters(base, spec, mesh)
    graphdef, state = nnx.split(model)
    plain = lora.plain_graphdef(model.config, model.task)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size - 1, (args.prompts, args.prompt_len)).astype(np.int32)
    mask = np.ones_like(ids)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, n=args.n, ignore_eos=True, seed=0)
    key = rollout_key(0)
    # As the trainer merges: the merged weights keep the base weights' shardings (the sampler compiles per layout).
    base_shardings = {lora.path_key(p): v.get_value().sharding for p, v in nnx.to_flat_state(state)}
    shapes = jax.eval_shape(functools.partial(lora.merged_weights, spec=spec), state)
    merge_weights = jax.jit(functools.partial(lora.merged_weights, spec=spec),
                            out_shardings={k: base_shardings[k] for k in shapes})
    merge = lambda s: lora.merged_state(s, spec, merge_weights(s))  # noqa: E731  as the trainer merges
    merged_sampler = Sampler(plain, mesh=mesh, max_positions=model.config.max_position_embeddings)
    low_rank_sampler = Sampler(graphdef, mesh=mesh, max_positions=model.config.max_position_embeddings)

    def merged():
        return merged_sampler.generate(merge(state), ids, mask, sampling, key).responses

    def low_rank():
        return low_rank_sampler.generate(state, ids, mask, sampling, key).responses

    _, base_state = nnx.split(base)

    def no_adapter():
        return merged_sampler.generate(base_state, ids, mask, sampling, key).responses

    merge_s = _best({"merge": lambda: merge(state)}, args.repeats)["merge"]
    sides = [("merged (incl. merge)", merged), ("low-rank path", low_rank), ("base model, no adapter", no_adapter)]
    rows = _best(dict(sides[::-1] if args.reverse else sides), args.repeats)
    tokens = args.prompts * args.n * args.new_tokens
    print(f"| sampler | seconds per rollout | tokens/s |  ({os.path.basename(path)}, rank {args.rank}, "
          f"{args.prompts}x{args.n} samples, {args.new_tokens} new tokens; merge alone {merge_s * 1e3:.1f} ms)")
    print("|---|---|---|")
    for name, seconds in sorted(rows.items()):
        print(f"| {name} | {seconds:.3f} | {tokens / seconds:.1f} |")
    ratio = rows["low-rank path"] / rows["merged (incl. merge)"]
    print(f"merged is {ratio:.2f}x the low-rank path's speed")
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": path, "rank": args.rank, "prompts": args.prompts, "n": args.n,
                       "new_tokens": args.new_tokens, "merge_s": merge_s, "seconds": rows, "merged_speedup": ratio}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
