"""verl's own example scripts (tests/config/verl_scripts/, unedited) train two steps with one word changed.

Each script builds its command in bash (environment defaults, arrays, ``"$@"``) and starts ``python3 -m
verl.trainer.main_ppo ...``. Here the entry point becomes ``-m rlhf_jax.main``; a ``python3`` first on PATH
records the command the shell built, and that exact argument list runs (through ``tests.train.helpers.run_main``).
The run is shrunk as a user shrinks these scripts: through the environment variables they read (the tiny model,
small batches and lengths) and, for what has no variable, arguments appended to the script's (one device, two
steps, a local output directory). The data the scripts name (``$HOME/data/gsm8k/*.parquet``,
``$HOME/data/math/*.parquet``, ``$HOME/data/rlla_4k/*.parquet``) is written in verl's parquet schema under a
temporary HOME, which also stands in for verl's checkout (``examples/<trainer>/`` holds the script; the GDPO script's
reward function sits at ``verl/utils/reward_score/rlla.py``).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.train.helpers import REPO, run_main, run_tool

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_scripts")
ENTRY = "-m verl.trainer.main_ppo"
# The scripts' own knobs (environment variables every one of them reads) shrink the run; what has no knob is
# appended as the script's arguments.
KNOBS = {"MODEL_PATH": "builtin:tiny", "STUDENT_MODEL": "builtin:tiny", "TEACHER_MODEL": "builtin:tiny", "TRAIN_BATCH_SIZE": "4", "PPO_MINI_BATCH_SIZE": "2", "MAX_PROMPT_LENGTH": "64",
         "MAX_RESPONSE_LENGTH": "4", "PPO_MAX_TOKEN_LEN_PER_GPU": "256", "ROLLOUT_N": "2", "NNODES": "1",
         "VERL_USE_UV": "0", "MICRO_BATCH_SIZE": "2"}
SHRINK = ["trainer.n_gpus_per_node=1", "data.val_batch_size=4", "trainer.total_training_steps=2",
          "trainer.val_before_train=False"]
# Older scripts read no variables: their sizes are overridden by arguments, as their users shrink them.
NO_KNOBS = {"grpo_trainer_run_qwen2-7b_seq_balance.sh": [
    "actor_rollout_ref.model.path=builtin:tiny", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "data.max_prompt_length=64", "data.max_response_length=4", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
    "actor_rollout_ref.rollout.n=2"]}
# The reward function the GDPO script names in verl's checkout: a stand-in returning the components it asks for.
RUBRIC = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    fmt = float(solution_str.strip().isdigit())
    acc = float(solution_str.strip() == str(ground_truth).strip())
    assert extra_info["experiment_name"], extra_info  # the gdpo reward manager hands it over
    return {"score": acc + fmt, "accuracy_reward": acc, "format_reward": fmt}
"""
RECORDER = """#!/bin/sh
# stands in for python3: records the command line the script built, one argument per line; a probe (python3 -c,
# the scripts' test for torch_npu) fails, as on a machine without Ascend NPUs
[ "$1" = "-c" ] && exit 1
for a in "$@"; do printf '%s\\n' "$a"; done > "$RECORDED_COMMAND"
"""


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A HOME with the parquet files the scripts name, and a bin directory whose python3 records its arguments."""
    home = tmp_path_factory.mktemp("home")
    for name in ("gsm8k", "math", "rlla_4k"):
        run_tool("rlhf_jax.data.synthetic", "--task", "arithmetic", "--out", str(home / "data" / name), "--train-size",
                 "16", "--test-size", "4", "--max-value", "4", timeout=120).check_returncode()
    rubric = home / "verl" / "utils" / "reward_score" / "rlla.py"
    rubric.parent.mkdir(parents=True)
    rubric.write_text(RUBRIC)
    recorder = home / "bin" / "python3"
    recorder.parent.mkdir()
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    return home


def built_command(script: str, home, out: str, folder: str | None = None, cwd=REPO,
                  extra: tuple[str, ...] = ()) -> list[str]:
    """The argument list the script's shell passes to python3, entry point replaced, shrinking overrides after it
    (the script in ``home/examples/<folder>``; ``folder`` default: its name's trainer part)."""
    text = open(os.path.join(SCRIPTS, script)).read()
    assert text.count(ENTRY) == 1, script
    name = os.path.basename(script)
    runnable = home / "examples" / (folder or name.split("_run_")[0]) / name  # REPO_ROOT (two folders up) is HOME
    runnable.parent.mkdir(parents=True, exist_ok=True)
    runnable.write_text(text.replace(ENTRY, "-m rlhf_jax.main"))
    recorded = home / (name + ".args")
    env = dict(os.environ, HOME=str(home), PATH=f"{home / 'bin'}{os.pathsep}{os.environ['PATH']}",
               RECORDED_COMMAND=str(recorded), **KNOBS)
    subprocess.run(["bash", str(runnable), *SHRINK, *NO_KNOBS.get(script, ()), f"trainer.default_local_dir={out}",
                    *extra], env=env, cwd=cwd, check=True, capture_output=True, timeout=60)
    args = recorded.read_text().split("\n")[:-1]
    assert args[:2] == ["-m", "rlhf_jax.main"], args[:4]
    return args[2:]


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(SCRIPTS) if f.endswith(".sh")))
def test_script_trains_two_steps(script, home, tmp_path):
    out = str(tmp_path / "run")
    args = built_command(script, home, out)
    # every one keeps some parameters in host memory (the reference's, the actor's): honoured, not ignored
    assert any(".fsdp_config.param_offload=True" in a for a in args)
    proc = run_main(args, devices=1, env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "2/2" in proc.stdout + proc.stderr and "step 2 |" in proc.stdout + proc.stderr
    from rlhf_jax.runtime.checkpoint import Checkpointer

    checkpoints = Checkpointer(os.path.join(out, "checkpoints"), async_save=False)
    try:  # save_freq=20 in every script: verl saves at the last step too
        assert checkpoints.all_steps() == [2]
    finally:
        checkpoints.close()


def _interaction_rows(split: str, n: int):
    """Rows as verl's examples/data_preprocess/gsm8k_multiturn_w_interaction.py writes them (small sums)."""
    import pandas as pd

    instruction = "Let's think step by step and output the final answer after `####`."
    rows = []
    for i in range(n):
        question = f"What is {i % 5 + 1} + {i % 4 + 1}? {instruction}"
        solution = str(i % 5 + i % 4 + 2)
        rows.append({"data_source": "openai/gsm8k", "ability": "math",
                     "prompt": [{"role": "system", "content": "You are a math expert. Put your final answer in the "
                                                              "format of `#### <answer>`."},
                                {"role": "user", "content": question}],
                     "reward_model": {"style": "rule", "ground_truth": solution},
                     "extra_info": {"split": split, "index": i, "answer": f"#### {solution}", "question": question,
                                    "interaction_kwargs": {"name": "gsm8k", "query": question,
                                                           "ground_truth": solution}}})
    return pd.DataFrame(rows)


def test_the_interaction_example_trains_with_verls_gsm8k_interaction(home, tmp_path):
    """verl's interaction example: --config-path/--config-name compose its YAML over verl's defaults, its
    interaction file names verl's Gsm8kInteraction, and each rule-scored episode goes on while the interaction
    asks the model to try again."""
    import shutil

    data = home / "data" / "gsm8k_verl_sgl_multi_turn_w_interaction"
    data.mkdir(parents=True, exist_ok=True)
    _interaction_rows("train", 16).to_parquet(data / "train.parquet")
    _interaction_rows("test", 4).to_parquet(data / "test.parquet")
    shutil.copytree(os.path.join(SCRIPTS, "sglang_multiturn", "config"), home / "examples" / "sglang_multiturn" / "config",
                    dirs_exist_ok=True)
    out = str(tmp_path / "run")
    mt = "actor_rollout_ref.rollout.multi_turn."
    args = built_command("sglang_multiturn/run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh", home, out,
                         folder="sglang_multiturn", cwd=home, extra=(  # PROJECT_DIR is where the script starts
                             "actor_rollout_ref.model.path=builtin:tiny", "data.max_prompt_length=192",
                             "data.max_response_length=320", mt + "max_tokens_per_turn=4", "actor_rollout_ref.rollout.n=2",
                             "trainer.logger=[console,jsonl]",
                             "actor_rollout_ref.model.enable_activation_offload=False"))  # refused: see SOURCE.md
    assert args[:2] == [f"--config-path={home}/examples/sglang_multiturn/config",
                        "--config-name=gsm8k_multiturn_grpo_w_interaction"], args[:2]
    proc = run_main(args, devices=1, env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    from tests.train.helpers import read_metrics

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["multi_turn/num_turns/mean"] > 1  # the interaction asked again
        assert 0 < r["multi_turn/masked_token_fraction"] < 1  # its messages sit in the responses, untrained
        assert "multi_turn/interaction_score/mean" in r


def test_the_tool_example_trains_unedited_with_verls_gsm8k_tool(home, tmp_path):
    """verl's multi-turn tool example, as it is: its tool file names verl's Gsm8kTool (calc_gsm8k_reward, graded
    against each row's tools_kwargs) and it over-samples its training rollouts (over_sample_rate=0.1)."""
    import shutil

    own = tmp_path / "home"  # its data ($HOME/data/gsm8k) are GSM8K rows with tool arguments, not the module's
    shutil.copytree(home / "bin", own / "bin")
    data = own / "data" / "gsm8k"
    data.mkdir(parents=True)
    for split, n in (("train", 16), ("test", 4)):
        rows = _interaction_rows(split, n)
        rows["extra_info"] = [{**e, "need_tools_kwargs": True, "tools_kwargs": {"calc_gsm8k_reward": {
            "create_kwargs": {"ground_truth": e["interaction_kwargs"]["ground_truth"]}}}} for e in rows["extra_info"]]
        rows.to_parquet(data / f"{split}.parquet")
    shutil.copytree(os.path.join(SCRIPTS, "sglang_multiturn", "config"), own / "examples" / "sglang_multiturn" / "config")
    out = str(tmp_path / "run")
    a = "actor_rollout_ref."
    args = built_command("sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh", own, out, folder="sglang_multiturn",
                         cwd=own, extra=(  # its sizes are written in the script: shrunk as its users shrink them
                             a + "model.path=builtin:tiny", "data.train_batch_size=4", a + "actor.ppo_mini_batch_size=2",
                             a + "actor.ppo_micro_batch_size_per_gpu=2", a + "rollout.log_prob_micro_batch_size_per_gpu=2",
                             a + "ref.log_prob_micro_batch_size_per_gpu=2", a + "rollout.n=2",
                             "data.max_prompt_length=448", "data.max_response_length=64",
                             "trainer.logger=[console,jsonl]"))
    assert "actor_rollout_ref.rollout.over_sample_rate=0.1" in args
    proc = run_main(args, devices=1, env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    from tests.train.helpers import read_metrics

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # a multi-turn rollout with the tool in its prompts, over-sampled
        assert r["multi_turn/num_turns/mean"] >= 1 and "multi_turn/aborted_fraction" in r
