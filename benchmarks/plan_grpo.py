"""Will it fit? The plan (python -m rlhf_jax.plan) of GRPO runs of real model sizes on TPU slices and GPU nodes.

Qwen2.5-0.5B, Qwen2.5-7B and Qwen3-30B-A3B (config.json bundled in rlhf_jax/plan/model_configs: no download),
n = 8 samples of 64 prompts a step, prompts up to 1024 and responses up to 2048 tokens, 4 actor mini-batches, a KL
loss against the reference, bfloat16 compute with float32 master weights, remat on, parameters sharded over every
device (mesh.fsdp), micro-batches of packed tokens sized by the memory plan (token budget -1: the largest that
XLA's estimate fits; the forward passes inherit it), LoRA (rank 32, every linear layer) or full fine-tuning. Each case runs in its own process, one
at a time (the compiles of a 7B run take minutes on a small CPU), and its line is appended to the JSON file.

    python benchmarks/plan_grpo.py                                  # every case; writes benchmarks/results/plan_grpo.json
    python benchmarks/plan_grpo.py --models Qwen/Qwen2.5-0.5B-Instruct --targets v5p-8 --modes full
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen3-30B-A3B")
TARGETS = ("h100-8", "v5p-8", "v6e-8")
MODES = ("lora", "full")


def overrides(model: str, mode: str) -> list[str]:
    """The command-line overrides of one case (the exact command is printed in the results)."""
    a = "--config.actor_rollout_ref."
    out = [f"{a}model.path={model}", "--config.data.max_prompt_length=1024", "--config.data.max_response_length=2048",
           f"{a}rollout.n=8", "--config.data.train_batch_size=64", f"{a}actor.ppo_mini_batch_size=16",
           f"{a}model.compute_dtype=bfloat16", f"{a}rollout.dtype=bfloat16",
           f"{a}model.enable_gradient_checkpointing=True", "--config.mesh.data=1", "--config.mesh.fsdp=-1",
           "--config.mesh.context=1", f"{a}actor.use_dynamic_bsz=True", f"{a}actor.ppo_max_token_len_per_gpu=-1"]
    if mode == "lora":
        out += [f"{a}model.lora_rank=32", f"{a}model.lora_alpha=64"]
    return out


def one_case(model: str, target: str, mode: str) -> dict:
    """Plan one case in this process."""
    from rlhf_jax.config import load_config_from_argv
    from rlhf_jax.plan import format_table, plan_run

    argv = ["plan", "--config=configs/grpo.py"] + overrides(model, mode)
    cfg = load_config_from_argv(argv)
    start = time.perf_counter()
    try:
        plan = plan_run(cfg, target, progress=lambda line: print(line, file=sys.stderr, flush=True),
                        stop_at_first_problem=False)
    except ValueError as e:  # e.g. LoRA on a Mixture-of-Experts model
        return {"model": model, "target": target, "mode": mode, "error": str(e)}
    table = format_table(plan)
    print(table, file=sys.stderr)
    return {"model": model, "target": target, "mode": mode, "fits": plan.fits, "problems": plan.problems,
            "peak_gib": plan.peak_bytes / 2**30, "usable_gib": plan.usable_bytes / 2**30,
            "resident_gib": plan.resident_bytes / 2**30, "step_s": plan.step_s, "sampling_s": plan.sampling_s,
            "training_s": plan.training_s, "micro_batches": plan.micro_batches,
            "compile_s": time.perf_counter() - start, "table": table,
            "command": "python -m rlhf_jax.plan --config=configs/grpo.py --topology=" + target + " "
                       + " ".join(overrides(model, mode))}


def markdown(rows: list[dict]) -> str:
    lines = ["| model | mode | target | fits | GiB per device (peak / usable) | roofline step | sampling / training "
             "| plan time here |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["model"].split("/")[-1]
        if "error" in r:
            lines.append(f"| {name} | {r['mode']} | {r['target']} | - | {r['error']} | | | |")
            continue
        split = (f"{r['sampling_s']:.0f} s / {r['training_s']:.0f} s" if r["step_s"] else "-")
        lines.append(f"| {name} | {r['mode']} | {r['target']} | {'yes' if r['fits'] else '**no**'} | "
                     f"{r['peak_gib']:.1f} / {r['usable_gib']:.1f} | {r['step_s'] or 0:.0f} s | {split} | "
                     f"{r['compile_s']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--targets", nargs="+", default=TARGETS)
    p.add_argument("--modes", nargs="+", default=MODES)
    p.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "plan_grpo.json"))
    p.add_argument("--case", nargs=3, metavar=("MODEL", "TARGET", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        print(json.dumps(one_case(*args.case)))
        return
    rows = []
    if os.path.exists(args.json):
        with open(args.json) as f:
            rows = json.load(f)
    for model in args.models:
        for mode in args.modes:
            for target in args.targets:
                rows = [r for r in rows if (r["model"], r["target"], r["mode"]) != (model, target, mode)]
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", model, target, mode],
                                      cwd=REPO, capture_output=True, text=True)
                if proc.returncode != 0:
                    tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
                    rows.append({"model": model, "target": target, "mode": mode, "error": tail[0][:300]})
                else:
                    rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
                os.makedirs(os.path.dirname(args.json), exist_ok=True)
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print(markdown(rows))


if __name__ == "__main__":
    main()
