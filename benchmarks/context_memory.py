"""Per-device memory of one forward+backward of SmolLM2-135M on one packed row, split over mesh.context.

For each row length and context split, compiles the gradient of the packed log-prob loss (the actor update's
forward+backward: the decoder over one packed row of two sequences, the chunked vocabulary projection at every
position) on (context=c) of 8 fake CPU devices, with abstract parameters (no weights are read), and prints XLA's
per-device temporary bytes (``compiled.memory_analysis()``) as a markdown table. SmolLM2's 9 query heads divide
no split, so the split runs the key/value-gather attention (``models/context_gather.py``). ``--measure`` also runs
one step of each cell in a fresh process on random parameters and reports that process's peak RSS (all 8 fake
devices live in it: the whole, not the per-device, memory).

    python benchmarks/context_memory.py                              # 8k, 16k, 32k x context 1, 2, 4, 8
    python benchmarks/context_memory.py --lengths 1024 2048 --contexts 1 2
    python benchmarks/context_memory.py --lengths 2048 --measure
    taskset -c 1 python benchmarks/context_memory.py --lengths 3072 --contexts 1 2 3 4 8 --measure --repeat 2
                                                  # the split's overhead: every cell's whole work on one core
    python benchmarks/context_memory.py --longest 3072     # per split, the longest row a 3 GiB device can train
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DTYPES = ("float32", "bfloat16")


def smollm2_config() -> dict:
    """SmolLM2-135M-Instruct's config.json (``python -m rlhf_jax.tools.smollm2`` puts it at builtin:smollm2)."""
    from rlhf_jax.plan.abstract import hf_config

    return hf_config("builtin:smollm2")


def packed_row(length: int):
    """One row of two packed sequences (segments 1 and 2, positions restarting), every position predicted."""
    import numpy as np

    half = length // 2
    segments = np.concatenate([np.full(half, 1), np.full(length - half, 2)]).astype(np.int32)[None]
    positions = np.concatenate([np.arange(half), np.arange(length - half)]).astype(np.int32)[None]
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 49152, (1, length)).astype(np.int32)
    return {"input_ids": ids, "positions": positions, "segment_ids": segments,
            "logit_positions": np.arange(length, dtype=np.int32),
            "logit_token_ids": np.roll(ids, -1, axis=1).reshape(-1)}


def build(length: int, context: int, args):
    """(compiled gradient program, abstract params, micro-batch placed on the mesh)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rlhf_jax import models
    from rlhf_jax.models.config import TASK_CAUSAL_LM
    from rlhf_jax.models.sequence_split import traced_with_split
    from rlhf_jax.parallel import make_mesh
    from rlhf_jax.parallel.mesh import DEFAULT_RULES
    from rlhf_jax.plan.abstract import abstract_model
    from rlhf_jax.train.packed_steps import packed_log_probs

    mesh = make_mesh(data=1, fsdp=1, context=context, devices=jax.devices()[:context])
    cfg = models.from_hf_dict(smollm2_config(), dtype=jnp.dtype(args.dtype), param_dtype=jnp.float32,
                              remat=args.remat, attn_impl=args.attn, context_attention=args.context_attention)
    graphdef, params = nnx.split(abstract_model(cfg, TASK_CAUSAL_LM, mesh, DEFAULT_RULES))
    micro = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
             for k, v in packed_row(length).items()}

    def loss_grads(p, micro):
        def loss(p):
            return -jnp.sum(packed_log_probs(nnx.merge(graphdef, p), micro, 1.0, False, dp=1)[0])

        return jax.value_and_grad(loss)(p)

    shardings = jax.tree.map(lambda x: x.sharding, params)
    fn = jax.jit(traced_with_split(loss_grads, mesh), out_shardings=(None, shardings))
    compiled = fn.lower(params, micro).compile()
    return compiled, params, micro


def cell(length: int, context: int, args) -> dict:
    import jax

    start = time.perf_counter()
    compiled, params, micro = build(length, context, args)
    memory = compiled.memory_analysis()
    out = {"length": length, "context": context, "temp": memory.temp_size_in_bytes,
           "args": memory.argument_size_in_bytes, "out": memory.output_size_in_bytes,
           "compile_s": time.perf_counter() - start,
           "gathers": compiled.as_text().count("all-gather-start") + compiled.as_text().count(" all-gather("),
           # The process's peak so far (compiling): a measured peak above it was set by the step.
           "peak_rss_compiled": peak_rss()}
    if args.measure:
        keys = jax.random.split(jax.random.key(0), len(jax.tree.leaves(params)))
        real = jax.tree.unflatten(jax.tree.structure(params), [
            jax.device_put(0.02 * jax.random.normal(k, x.shape, x.dtype), x.sharding)
            for k, x in zip(keys, jax.tree.leaves(params))])
        out["peak_rss_weights"] = peak_rss()
        for _ in range(args.repeat):  # the last run is timed (earlier ones warm the runtime up)
            start = time.perf_counter()
            jax.block_until_ready(compiled(real, micro))
        out["step_s"] = time.perf_counter() - start
        out["peak_rss"] = peak_rss()
    return out


def peak_rss() -> int:
    """The process's peak resident set so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def longest(context: int, budget: int, args, step: int = 4096) -> tuple[int, list[dict]]:
    """The longest row (a multiple of ``step`` tokens) whose step needs at most ``budget`` bytes per device
    (arguments + outputs + temporaries, XLA's estimate): doubling from ``step``, then halving the gap; (0 where
    even ``step`` does not fit, the cells compiled)."""
    tried = []

    def fits(length: int) -> bool:
        tried.append(cell(length, context, args))
        r = tried[-1]
        print(f"# context {context}: {length} tokens need {mib(r['temp'] + r['args'] + r['out'])} MiB", file=sys.stderr,
              flush=True)
        return r["temp"] + r["args"] + r["out"] <= budget

    low, high = 0, step
    while fits(high):
        low, high = high, 2 * high
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low, tried


def print_longest(args) -> None:
    budget = args.longest * 2**20
    print(f"SmolLM2-135M, one packed row, forward+backward; compute {args.dtype}, remat {args.remat}, attention "
          f"{args.attn}; the longest row whose step fits {args.longest:,} MiB per device (XLA's estimate of "
          "arguments + outputs + temporaries)\n")
    print("| context | longest row (tokens) | per device at it (MiB) | next length tried (MiB) | compiles |")
    print("|---|---|---|---|---|")
    for context in args.contexts:
        length, tried = longest(context, budget, args)
        need = {r["length"]: r["temp"] + r["args"] + r["out"] for r in tried}
        over = min((n for n in need if n > length), default=None)
        print(f"| {context} | {length:,} | {mib(need.get(length))} | "
              f"{'-' if over is None else f'{over:,}: {mib(need[over])}'} | {len(tried)} |", flush=True)


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="compute dtype (parameters float32)")
    parser.add_argument("--remat", default="full", help="remat policy of each layer (none, full, dots_saveable)")
    parser.add_argument("--attn", default="blockwise", help="attention implementation (model.attn_implementation)")
    parser.add_argument("--context-attention", default="auto", help="mesh.context_attention: auto, ulysses, gather")
    parser.add_argument("--measure", action="store_true", help="also run one step per cell (fresh process each)")
    parser.add_argument("--repeat", type=int, default=1, help="with --measure: steps per cell, the last one timed")
    parser.add_argument("--longest", type=int, metavar="MIB", help="per context, the longest row whose step fits "
                        "MIB per device (XLA's estimate; compiles only)")
    parser.add_argument("--cell", type=int, nargs=2, metavar=("LENGTH", "CONTEXT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:  # one cell in this process: its peak RSS is its own
        print(json.dumps(cell(*args.cell, args)))
        return
    if args.longest:
        print_longest(args)
        return
    rows = []
    for length in args.lengths:
        for context in args.contexts:
            if args.measure:
                flags = [a for a in sys.argv[1:] if a not in ("--lengths", "--contexts", "--repeat") and not a.isdigit()]
                flags += ["--repeat", str(args.repeat)]
                done = subprocess.run([sys.executable, __file__, "--cell", str(length), str(context), *flags],
                                      capture_output=True, text=True)
                if done.returncode:
                    print(done.stderr[-2000:], file=sys.stderr)
                    rows.append({"length": length, "context": context, "temp": None, "args": None})
                    continue
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            else:
                rows.append(cell(length, context, args))
            print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    print(f"SmolLM2-135M, one packed row, forward+backward; compute {args.dtype}, remat {args.remat}, attention "
          f"{args.attn}, mesh.context_attention={args.context_attention}; MiB per device (XLA's estimate)\n")
    measured = " peak RSS, all devices (MiB) | step s |" if args.measure else ""
    print(f"| tokens | context | temporary | arguments | temporary x context | compile s |{measured}")
    print("|---|---|---|---|---|---|" + ("---|---|" if args.measure else ""))
    for r in rows:
        temp = r["temp"]
        line = (f"| {r['length']} | {r['context']} | {mib(temp)} | {mib(r['args'])} | "
                f"{mib(None if temp is None else temp * r['context'])} | {r.get('compile_s', 0):.0f} |")
        if args.measure:
            line += f" {mib(r.get('peak_rss'))} | {r.get('step_s', float('nan')):.1f} |"
        print(line)


if __name__ == "__main__":
    main()
