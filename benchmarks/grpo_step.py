"""One GRPO step on SmolLM2-135M-Instruct: rlhf_jax (packed and padded) against TRL's GRPOTrainer, same run.

The step: 8 prompts ``What is {a}+{b}? Answer with just the number.`` (a, b uniform in 1..50, the
model's chat template) x 8 samples, up to 128 new tokens stopping at EOS, temperature 1, KL loss k3
(low_var_kl) with coefficient 0.04, lr 1e-6, one PPO epoch, one mini-batch, float32 on CPU.
Reported: seconds per step (median of steps 2-4) for each system and the ratios, rlhf_jax's stage
breakdown (each stage's timer waits for its outputs), real vs padded vs packed token counts, the
actor update's FLOPs counted on real tokens per second as a fraction of the float32 matmul rate
measured in the same run, and the process's resident memory after every step.

    pip install -e '.[bench]'
    python benchmarks/grpo_step.py            # writes benchmarks/results/grpo_step.json

TRL runs in a subprocess of this script (``--trl``) so torch and XLA do not share threads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
if __name__ == "__main__" and "--trl" not in sys.argv:  # rlhf_jax's side runs as rlhf_jax.main does
    from rlhf_jax.hostmem import reexec_with_hugepages

    reexec_with_hugepages()

PROMPTS, SAMPLES, NEW_TOKENS, STEPS = 8, 8, 128, 4
KL_COEF, LR = 0.04, 1e-6


def make_prompts(steps: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(steps * PROMPTS):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        rows.append({"data_source": "addition", "question": f"What is {a}+{b}? Answer with just the number.",
                     "answer": str(a + b)})
    return rows


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1 when the last number in the response is the sum, else 0 (the same rule for both systems)."""
    numbers = re.findall(r"-?\d+", solution_str)
    return 1.0 if numbers and numbers[-1] == str(ground_truth) else 0.0


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024**3


# ----------------------------------------------------------------------------- rlhf_jax
def settings_config(model_dir: str, data_file: str, packed: bool, out_dir: str):
    """The recipe configs/grpo.py with this benchmark's settings (not finalized)."""
    from tests.train.helpers import load_recipe

    cfg = load_recipe("grpo")
    settings = {
        "actor_rollout_ref.model.path": model_dir, "data.train_files": (data_file,), "data.val_files": (data_file,),
        "data.prompt_template": "native", "data.max_prompt_length": 64, "data.max_response_length": NEW_TOKENS,
        "data.train_batch_size": PROMPTS, "data.shuffle": False, "actor_rollout_ref.rollout.n": SAMPLES,
        "actor_rollout_ref.rollout.temperature": 1.0, "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.kl_loss_type": "low_var_kl", "actor_rollout_ref.actor.kl_loss_coef": KL_COEF,
        "actor_rollout_ref.actor.optim.lr": LR, "actor_rollout_ref.actor.ppo_epochs": 1,
        "actor_rollout_ref.actor.ppo_mini_batch_size": PROMPTS, "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "actor_rollout_ref.model.use_remove_padding": packed,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": -1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": -1,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": -1,
        "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False,
        "custom_reward_function.path": os.path.abspath(__file__), "custom_reward_function.name": "compute_score",
        "trainer.total_training_steps": STEPS, "trainer.test_freq": 0, "trainer.val_before_train": False,
        "trainer.logger": ("console",), "trainer.default_local_dir": out_dir, "trainer.log_dir": out_dir,
        "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1,
    }
    for path, value in settings.items():
        node = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def run_rlhf_jax(model_dir: str, data_file: str, packed: bool, out_dir: str) -> dict:
    from rlhf_jax.train.trainer import Trainer

    trainer = Trainer(settings_config(model_dir, data_file, packed, out_dir))
    start = time.perf_counter()
    trainer.plan_memory()
    plan_s = time.perf_counter() - start
    steps = []
    for step in range(STEPS):
        m = trainer.train_on(next(trainer.loader), step)
        m["rss_gib"] = rss_gib()
        steps.append({k: v for k, v in m.items() if isinstance(v, (int, float))})
        print(f"  rlhf_jax packed={packed} step {step + 1}: {m['timing_s/step']:.1f} s "
              f"(gen {m['timing_s/gen']:.1f}, ref {m.get('timing_s/ref', 0):.1f}, update {m['timing_s/update_actor']:.1f}); "
              f"score {m['critic/score/mean']:.3f}, response {m['response_length/mean']:.1f} tokens, rss {m['rss_gib']:.2f} GiB",
              flush=True)
    num_params = trainer.num_params
    trainer.close()
    return {"steps": steps, "memory_plan_s": plan_s, "num_params": int(num_params)}


# ----------------------------------------------------------------------------- TRL
def run_trl(model_dir: str, data_file: str, out_dir: str) -> dict:
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    rows = [json.loads(line) for line in open(data_file)]
    ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"]} for r in rows])

    def reward(completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [compute_score("addition", t, a) for t, a in zip(texts, answer)]

    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES,
        gradient_accumulation_steps=1, max_completion_length=NEW_TOKENS, temperature=1.0, beta=KL_COEF,
        learning_rate=LR, num_iterations=1, max_steps=STEPS, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, bf16=False, seed=0, shuffle_dataset=False, dataloader_num_workers=0,
    )
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)
            print(f"  TRL step {len(times)}: {times[-1]:.1f} s, rss {rss_gib():.2f} GiB", flush=True)

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[Timer()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"step_s": times, "torch_threads": torch.get_num_threads(), "logs": logs, "trl_version": __import__("trl").__version__}


def model_shaped_matmul_flops(tokens: int = 6144) -> float:
    """float32 FLOP/s of the update's typical matmul here: (tokens x 576) @ (576 x 1536), SmolLM2's MLP."""
    import jax
    import jax.numpy as jnp

    a, b = jnp.ones((tokens, 576), jnp.float32), jnp.ones((576, 1536), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * tokens * 576 * 1536 / best


# ----------------------------------------------------------------------------- report
def median_steps(values: list[float]) -> float:
    return statistics.median(values[1:4]) if len(values) >= 4 else statistics.median(values)


def report(ours: dict, padded: dict, trl: dict | None, machine: dict) -> dict:
    stages = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor")

    def med(run, key):
        return median_steps([s.get(key, 0.0) for s in run["steps"]])

    out = {"machine": machine, "stages_packed": {k: med(ours, f"timing_s/{k}") for k in stages + ("step",)},
           "stages_padded": {k: med(padded, f"timing_s/{k}") for k in stages + ("step",)}}
    steady = ours["steps"][1:]
    real = statistics.mean(s["perf/real_tokens"] for s in steady)
    out["tokens"] = {"real": real, "padded_unpacked": statistics.mean(s["perf/padded_tokens_unpacked"] for s in steady),
                     "packed_update": statistics.mean(s.get("perf/packed_tokens/update_actor", 0) for s in steady),
                     "placed_update": statistics.mean(s.get("perf/placed_tokens/update_actor", 0) for s in steady),
                     "response_length_mean": statistics.mean(s["response_length/mean"] for s in steady),
                     "response_length_max": max(s["response_length/max"] for s in steady)}
    flops = 6.0 * ours["num_params"] * real  # forward + backward, every parameter is in a matmul (tied head)
    out["update_flops_per_s_real_tokens"] = flops / out["stages_packed"]["update_actor"]
    out["update_fraction_of_matmul"] = out["update_flops_per_s_real_tokens"] / machine["matmul_flops"]
    out["update_fraction_of_model_matmul"] = out["update_flops_per_s_real_tokens"] / machine["model_matmul_flops"]
    # What the update actually computes: each shared prompt once (see rlhf_jax.batch.packing).
    out["update_fraction_of_matmul_computed_tokens"] = (6.0 * ours["num_params"] * out["tokens"]["placed_update"]
                                                        / out["stages_packed"]["update_actor"] / machine["matmul_flops"])
    train_packed = out["stages_packed"]["ref"] + out["stages_packed"]["update_actor"]
    train_padded = out["stages_padded"]["ref"] + out["stages_padded"]["update_actor"]
    out["packing_speedup_ref_plus_update"] = train_padded / train_packed
    out["rss_gib_per_step"] = {"packed": [s["rss_gib"] for s in ours["steps"]],
                               "padded": [s["rss_gib"] for s in padded["steps"]]}
    if trl:
        out["trl_step_s"] = median_steps(trl["step_s"])
        out["ratio_vs_trl"] = out["trl_step_s"] / out["stages_packed"]["step"]
        out["ratio_vs_trl_padded"] = out["trl_step_s"] / out["stages_padded"]["step"]
        out["trl"] = trl
    return out


def print_table(r: dict) -> None:
    p, q = r["stages_packed"], r["stages_padded"]
    print("\n| stage (median of steps 2-4, s) | rlhf_jax packed | rlhf_jax padded |")
    print("|---|---|---|")
    for k in p:
        print(f"| {k} | {p[k]:.2f} | {q[k]:.2f} |")
    t = r["tokens"]
    print(f"\ntokens per step: real {t['real']:.0f}, padded rows {t['padded_unpacked']:.0f}, packed update rows "
          f"{t['packed_update']:.0f} holding {t['placed_update']:.0f} tokens (each group's prompt once); response "
          f"length mean {t['response_length_mean']:.1f}, max {t['response_length_max']:.0f}")
    print(f"matmul rate (float32, this run): square {r['machine']['matmul_flops'] / 1e9:.1f} GFLOP/s, SmolLM2-shaped "
          f"(6144x576 @ 576x1536) {r['machine']['model_matmul_flops'] / 1e9:.1f} GFLOP/s; actor update on real tokens: "
          f"{r['update_flops_per_s_real_tokens'] / 1e9:.1f} GFLOP/s = {r['update_fraction_of_matmul']:.2f} of square, "
          f"{r['update_fraction_of_model_matmul']:.2f} of SmolLM2-shaped; on the tokens it computes: "
          f"{r['update_fraction_of_matmul_computed_tokens']:.2f} of square")
    print(f"packing speed-up of the training passes (ref + update): {r['packing_speedup_ref_plus_update']:.2f}x")
    print(f"resident memory after each step (GiB): packed {r['rss_gib_per_step']['packed']}, "
          f"padded {r['rss_gib_per_step']['padded']}")
    if "trl_step_s" in r:
        print(f"TRL GRPOTrainer {r['trl']['trl_version']} ({r['trl']['torch_threads']} torch threads): "
              f"{r['trl_step_s']:.1f} s/step; rlhf_jax packed {p['step']:.1f} s/step -> "
              f"**{r['ratio_vs_trl']:.2f}x** (padded: {r['ratio_vs_trl_padded']:.2f}x)")


def main(argv=None) -> int:
    global STEPS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trl", metavar="JSON_OUT", help=argparse.SUPPRESS)  # internal: run TRL only
    ap.add_argument("--skip-trl", action="store_true", help="measure rlhf_jax only")
    ap.add_argument("--steps", type=int, default=4, help="steps per system (the median is over steps 2-4)")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "grpo_step.json"))
    args = ap.parse_args(argv)
    STEPS = args.steps
    from rlhf_jax.tools import smollm2

    model_dir = smollm2.ensure(verbose=True)
    work = tempfile.mkdtemp(prefix="grpo_step_")
    data_file = os.path.join(work, "train.jsonl")
    with open(data_file, "w") as f:
        for r in make_prompts(STEPS):
            f.write(json.dumps({"data_source": r["data_source"], "prompt": [{"role": "user", "content": r["question"]}],
                                "reward_model": {"ground_truth": r["answer"]}}) + "\n")
    if args.trl:
        with open(args.trl, "w") as f:
            json.dump(run_trl(model_dir, data_file, os.path.join(work, "trl")), f)
        return 0

    from benchmarks.rollout import measure_matmul_flops

    trl = None
    if not args.skip_trl:
        print("TRL GRPOTrainer (subprocess)...", flush=True)
        trl_json = os.path.join(work, "trl.json")
        # TRL as its users run it: without the huge-page malloc tunable rlhf_jax.main adds for itself.
        env = dict(os.environ)
        tunables = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb")]
        if tunables:
            env["GLIBC_TUNABLES"] = ":".join(tunables)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--trl", trl_json, "--steps", str(STEPS)],
                              cwd=REPO, env=env)
        if proc.returncode != 0:
            print("TRL run failed", file=sys.stderr)
            return proc.returncode
        trl = json.load(open(trl_json))
    print("rlhf_jax, packed...", flush=True)
    ours = run_rlhf_jax(model_dir, data_file, True, os.path.join(work, "packed"))
    print("rlhf_jax, padded...", flush=True)
    padded = run_rlhf_jax(model_dir, data_file, False, os.path.join(work, "padded"))
    machine = {"matmul_flops": measure_matmul_flops(), "model_matmul_flops": model_shaped_matmul_flops()}
    result = report(ours, padded, trl, machine)
    result["runs"] = {"packed": ours, "padded": padded}
    print_table(result)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
