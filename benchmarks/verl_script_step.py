"""One GRPO step started from verl's own script, against benchmarks/grpo_step.py's step, same run.

verl's ``examples/grpo_trainer/run_qwen2-7b_seq_balance.sh`` (release v0.7.1, kept unedited in
tests/config/verl_scripts/) runs with one word changed (``verl.trainer.main_ppo`` -> ``rlhf_jax.main``), through
bash, with ``python3`` on PATH being this interpreter. It is shrunk to grpo_step.py's configuration
(SmolLM2-135M-Instruct, 8 addition prompts x 8 samples, 128 new tokens, KL loss 0.04, ...) by arguments the script
appends (``$@``), in verl's syntax, as a user shrinks it; the prompts are grpo_step.py's, written as verl's
``$HOME/data/gsm8k/{train,test}.parquet`` under a temporary HOME. Before timing anything, the configuration the
command line gives is compared with grpo_step.py's, key by key after finalizing: the benchmark stops if any key
differs other than the output paths and names, so the two runs do the same work.

Reported: seconds per step (median of steps 2-4) of the script's run (read from its metrics.jsonl, each step's
timer waits for its outputs) and of grpo_step.py's packed run in this process, their ratio, both runs' scores and
response lengths (the same samples when the configurations agree), and the float32 matmul rate measured in the same
run.

    python benchmarks/verl_script_step.py     # writes benchmarks/results/verl_script_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
if __name__ == "__main__":  # the in-process run gets what rlhf_jax.main gives itself
    from rlhf_jax.hostmem import reexec_with_hugepages

    reexec_with_hugepages()

from benchmarks import grpo_step as G  # noqa: E402

SCRIPT = os.path.join(REPO, "tests", "config", "verl_scripts", "grpo_trainer_run_qwen2-7b_seq_balance.sh")
ENTRY, OURS = "verl.trainer.main_ppo", "rlhf_jax.main"


def shrink(model_dir: str, out: str) -> list[str]:
    """The arguments appended to the script: grpo_step.py's run in verl's key names."""
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_batch_size={G.PROMPTS}",
        "data.max_prompt_length=64", f"data.max_response_length={G.NEW_TOKENS}", "data.shuffle=False",
        "data.prompt_template=native", f"actor_rollout_ref.rollout.n={G.SAMPLES}",
        "actor_rollout_ref.rollout.temperature=1.0", f"actor_rollout_ref.actor.kl_loss_coef={G.KL_COEF}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={G.PROMPTS}", "actor_rollout_ref.actor.use_dynamic_bsz=False",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=-1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=-1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=-1",
        "actor_rollout_ref.ref.fsdp_config.param_offload=False",
        f"custom_reward_function.path={os.path.join(REPO, 'benchmarks', 'grpo_step.py')}",
        "custom_reward_function.name=compute_score", f"trainer.total_training_steps={G.STEPS}",
        "trainer.test_freq=0", "trainer.save_freq=-1", "trainer.logger=['console','jsonl']",
        "trainer.n_gpus_per_node=1", f"trainer.default_local_dir={out}", f"trainer.log_dir={out}",
        # the script's settings that grpo_step.py's configuration does not have
        "actor_rollout_ref.model.enable_gradient_checkpointing=False", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.max_num_seqs=null", "data.filter_overlong_prompts=False", "data.prompt_key=null",
        "trainer.total_epochs=1",
        # inert here (no dynamic batch sizes, no validation), set alike so that every key compares equal
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=16384", "data.val_batch_size=100",
        "trainer.log_val_generations=2",
    ]


def write_data(home: str) -> None:
    import pandas as pd

    rows = [{"data_source": r["data_source"], "prompt": [{"role": "user", "content": r["question"]}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": r["answer"]},
             "extra_info": {"index": i}} for i, r in enumerate(G.make_prompts(G.STEPS))]
    os.makedirs(os.path.join(home, "data", "gsm8k"))
    for split in ("train", "test"):
        pd.DataFrame(rows).to_parquet(os.path.join(home, "data", "gsm8k", f"{split}.parquet"))


def script_command(home: str, extra: list[str], python: str) -> list[str]:
    """Run the script (entry point replaced) with ``python`` as its python3; returns the argv it gave python3."""
    text = open(SCRIPT).read()
    assert text.count(ENTRY) == 1
    runnable = os.path.join(home, "run_qwen2-7b_seq_balance.sh")
    with open(runnable, "w") as f:
        f.write(text.replace(ENTRY, OURS))
    bin_dir = os.path.join(home, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    shim = os.path.join(bin_dir, "python3")
    if os.path.lexists(shim):
        os.remove(shim)
    os.symlink(python, shim)
    env = dict(os.environ, HOME=home, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", WANDB_MODE="offline")
    proc = subprocess.run(["bash", runnable, *extra], env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the script's run failed:\n{proc.stderr[-4000:]}")
    return proc.stdout, proc.stderr


def recorded_argv(home: str, extra: list[str]) -> list[str]:
    """The argument list the script's shell builds for python3 (a recording python3, no run)."""
    recorder = os.path.join(home, "record.sh")
    record = os.path.join(home, "argv.txt")
    with open(recorder, "w") as f:
        f.write(f"#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done > {record}\n")
    os.chmod(recorder, 0o755)
    script_command(home, extra, recorder)
    return open(record).read().split("\n")[:-1]


def finalized(cfg) -> dict:
    from rlhf_jax.config.validate import finalize

    return finalize(cfg, num_devices=1).to_dict()


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# Keys not compared: where a run writes and what it is called; the device counts (both give one device: the
# resolved mesh.* keys are compared); when checkpoints are written (grpo_step.py calls the steps directly and writes
# none; the script's run writes none while its steps are timed); the sections of roles GRPO does not build.
PATHS = ("trainer.default_local_dir", "trainer.log_dir", "trainer.project_name", "trainer.experiment_name",
         "trainer.profile_dir", "data.train_files", "data.val_files", "trainer.logger", "trainer.n_gpus_per_node",
         "trainer.nnodes", "trainer.save_freq", "critic.", "reward_model.")


def config_differences(argv: list[str], in_process_cfg) -> dict:
    from rlhf_jax.config import load_config_from_argv

    ours = flat(finalized(load_config_from_argv(["main", *argv[2:]])))
    theirs = flat(finalized(in_process_cfg))
    return {k: (ours.get(k), theirs.get(k)) for k in sorted(set(ours) | set(theirs))
            if ours.get(k) != theirs.get(k) and not k.startswith(PATHS) and not k.startswith("derived.")}


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "verl_script_step.json"))
    args = ap.parse_args(argv)
    from rlhf_jax.tools import smollm2

    model_dir = smollm2.ensure(verbose=True)
    home = tempfile.mkdtemp(prefix="verl_script_step_")
    write_data(home)
    out = os.path.join(home, "run")
    extra = shrink(model_dir, out)
    command = recorded_argv(home, extra)
    assert command[:2] == ["-m", OURS], command[:3]
    in_process = G.settings_config(model_dir, os.path.join(home, "data", "gsm8k", "train.parquet"), True,
                                   os.path.join(home, "packed"))
    differences = config_differences(command, in_process)
    if differences:
        for k, (a, b) in differences.items():
            print(f"  {k}: script {a!r} vs grpo_step {b!r}")
        raise SystemExit("the script's configuration differs from grpo_step.py's (above): fix shrink()")
    print(f"verl's script, {len(command) - 2} arguments, configuration equal to grpo_step.py's; running it...",
          flush=True)
    script_command(home, extra, sys.executable)
    script_steps = [r for r in read_metrics(out) if "timing_s/step" in r]
    print("grpo_step.py's packed run in this process...", flush=True)
    packed = G.run_rlhf_jax(model_dir, os.path.join(home, "data", "gsm8k", "train.parquet"), True,
                            os.path.join(home, "packed"))
    from benchmarks.rollout import measure_matmul_flops

    s_script = G.median_steps([r["timing_s/step"] for r in script_steps])
    s_inproc = G.median_steps([r["timing_s/step"] for r in packed["steps"]])
    result = {
        "script": os.path.relpath(SCRIPT, REPO), "steps": G.STEPS, "matmul_flops": measure_matmul_flops(),
        "script_step_s": s_script, "grpo_step_s": s_inproc, "ratio_script_over_grpo_step": s_script / s_inproc,
        "script_scores": [r["critic/score/mean"] for r in script_steps],
        "grpo_step_scores": [r["critic/score/mean"] for r in packed["steps"]],
        "script_response_lengths": [r["response_length/mean"] for r in script_steps],
        "grpo_step_response_lengths": [r["response_length/mean"] for r in packed["steps"]],
        "command": command,
    }
    print(f"\n| run | s/step (median of steps 2-{G.STEPS}) |\n|---|---|\n| verl's script, one word changed | "
          f"{s_script:.2f} |\n| benchmarks/grpo_step.py (packed) | {s_inproc:.2f} |\n| ratio | "
          f"{s_script / s_inproc:.3f} |\nfloat32 matmul rate {result['matmul_flops'] / 1e9:.0f} GFLOP/s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
