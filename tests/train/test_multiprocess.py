"""Two JAX processes (4 fake CPU devices each) over gloo on 127.0.0.1 train exactly like one process with 8 devices,
and the two-process run's checkpoint resumes in one process of 8 devices."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.parallel.rehearsal import free_port
from tests.train.helpers import REPO, Processes, cli_args, read_metrics, run_main

KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss",
        "response_length/mean", "val-core/arithmetic/reward/mean@1")


def _two_processes(out: str, devices_each: int, recipe: str = "grpo", launcher: bool = False, **overrides) -> None:
    """The run on two processes of ``devices_each`` fake CPU devices over gloo: through
    launch/local_multiprocess.sh with ``launcher``, else the same processes forked from the tests' pre-imported
    interpreter (helpers.Processes)."""
    args = cli_args(out, recipe, **overrides)
    if not launcher:
        with Processes(2, devices_each, args) as procs:
            _, stderr = procs.communicate(timeout=600)
        assert procs.returncode == 0, stderr[-3000:]
        return
    env = dict(os.environ, RLHF_JAX_PORT=str(free_port()),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    launched = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", str(devices_each),
                               *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL)
    assert launched.returncode == 0, launched.stderr[-3000:]


def _one_and_two_processes(tmp_path, devices_each: int, recipe: str, **overrides) -> tuple[list[dict], list[dict]]:
    """The metrics of the run in one process of 2 x ``devices_each`` devices and in two processes."""
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    proc = run_main(cli_args(single, recipe, **overrides), devices=2 * devices_each)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _two_processes(multi, devices_each, recipe, **overrides)
    return read_metrics(single), read_metrics(multi)


def test_two_processes_match_one_process(tmp_path):
    overrides = {"trainer.total_training_steps": 2, "trainer.test_freq": 2, "mesh.data": -1, "mesh.fsdp": 1,
                 "mesh.tensor": 1, "trainer.logger": ("console", "jsonl"), "trainer.save_freq": 2,
                 "data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 4}
    single = str(tmp_path / "single")  # one step further: the reference for the resumed run below
    proc = run_main(cli_args(single, **{**overrides, "trainer.total_training_steps": 3}), devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]

    multi = str(tmp_path / "multi")
    _two_processes(multi, 4, launcher=True, **overrides)  # the user's launcher, as the README runs it
    one, two = read_metrics(single), read_metrics(multi)
    assert [r["step"] for r in one] == [1, 2, 3] and [r["step"] for r in two] == [1, 2]
    assert "val-core/arithmetic/reward/mean@1" in two[-1]  # validation ran at the end, over both processes' prompts
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key in (k for k in KEYS if k in a):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)

    # The two-process checkpoint of step 2 restores in one process (8 devices) and step 3 is the one-process run's.
    resumed = str(tmp_path / "resumed")
    shutil.copytree(multi, resumed)
    proc = run_main(cli_args(resumed, **{**overrides, "trainer.total_training_steps": 3}), devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = read_metrics(resumed)
    assert [r["step"] for r in after] == [1, 2, 3]  # the copied log, then the resumed step
    for key in (k for k in KEYS if k in one[2]):
        assert after[2][key] == pytest.approx(one[2][key], rel=1e-5, abs=1e-7), key


def test_sft_two_processes_match_one_process(tmp_path):
    """SFT (packed rows; validation loss over a set that leaves a partial batch, and greedy accuracy) in two
    processes equals one process."""
    overrides = {"algorithm.type": "sft", "custom_reward_function.path": "", "data.train_batch_size": 8,
                 "data.train_files": ("builtin:arithmetic?max_value=4&train_size=64",),
                 "data.val_files": ("builtin:arithmetic?max_value=4&test_size=7",), "data.val_batch_size": 5,
                 "trainer.total_training_steps": 2, "trainer.test_freq": 2, "trainer.save_freq": 0, "mesh.data": -1,
                 "mesh.fsdp": 1, "mesh.tensor": 1, "trainer.logger": ("jsonl",)}
    one, two = _one_and_two_processes(tmp_path, 2, "sft", **overrides)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        for key in ("train/loss", "train/grad_norm", "train/loss_tokens", "val/loss", "val-core/arithmetic/reward/mean@1"):
            assert (key in a) == (key in b), key
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    assert "val/loss" in one[-1] and "val-core/arithmetic/reward/mean@1" in one[-1]


def test_dapo_dynamic_sampling_in_two_processes_matches_one_process(tmp_path):
    """DAPO's dynamic sampling (algorithm.filter_groups) over two processes: every process sees every group's
    scores, so both keep the same groups and draw the same further batches, and each trains its block of the kept
    rows, as one process does with the whole batch."""
    from tests.train.test_verl_semantics import HALF_FLAT_REWARD

    reward = tmp_path / "reward.py"
    reward.write_text(HALF_FLAT_REWARD)
    overrides = {"custom_reward_function.path": str(reward), "algorithm.filter_groups.metric": "acc",
                 "actor_rollout_ref.rollout.n": 4, "data.max_response_length": 8,
                 "reward_model.overlong_buffer.enable": False, "trainer.total_training_steps": 2, "mesh.data": -1,
                 "mesh.fsdp": 1, "mesh.tensor": 1, "trainer.logger": ("jsonl",)}
    one, two = _one_and_two_processes(tmp_path, 2, "dapo", **overrides)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    assert all(r["train/num_gen_batches"] >= 2 for r in one)  # half the groups are flat: one batch never fills
    for a, b in zip(one, two):
        for key in ("train/num_gen_batches", "critic/score/mean", "response_length/mean", "actor/pg_loss",
                    "actor/grad_norm", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


COUNTDOWN = '''
from rlhf_jax.agents.environment import Environment, StepResult


class Countdown(Environment):
    """Ends after as many moves as the task's answer (at least one), so games end at different turns on each
    process; replies and rewards vary with each move's length."""

    def reset(self, task):
        self.left = 1 + int(task["ground_truth"]) % 3
        return f"Count down from {self.left}."

    def step(self, action):
        self.left -= 1
        return StepResult("x" * (len(action) % 5 + 1), len(action) / 10, self.left <= 0)
'''


def test_multi_turn_conversations_in_two_processes_match_one_process(tmp_path):
    """An environment's conversations in two processes: each plays its own prompts' games, their replies of
    different lengths appended and the games ending at different turns, while both run the same programs (the
    widest new row and the turn count agreed between them). The run equals one process of 4 devices."""
    env = tmp_path / "countdown.py"
    env.write_text(COUNTDOWN)
    mt = "actor_rollout_ref.rollout.multi_turn."
    overrides = {mt + "enable": True, mt + "environment": f"{env}:Countdown", mt + "max_assistant_turns": 3,
                 mt + "max_tokens_per_turn": 6, "data.max_response_length": 120, "data.prompt_template": "native",
                 "data.max_prompt_length": 48, "trainer.total_training_steps": 2, "mesh.data": -1, "mesh.fsdp": 1,
                 "mesh.tensor": 1, "trainer.logger": ("jsonl",)}
    one, two = _one_and_two_processes(tmp_path, 2, "grpo", **overrides)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    assert any(r["multi_turn/num_turns/max"] > r["multi_turn/num_turns/mean"] for r in one)  # games of many lengths
    assert any(0 < r["multi_turn/masked_token_fraction"] < 1 for r in two)  # the replies, untrained
    for a, b in zip(one, two):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
                    "multi_turn/env_reward/mean", "multi_turn/num_turns/mean", "multi_turn/num_turns/max",
                    "multi_turn/masked_token_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


VARYING_AGENT = '''
def solve(client, task):
    """As many calls as the task's answer says (one to three): episodes end at different rounds on each process."""
    messages = [{"role": "user", "content": str(task["prompt"])}]
    for _ in range(1 + int(task["ground_truth"]) % 3):
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append({"role": "user", "content": "Again."})
    return len(messages[-2]["content"]) / 10
'''


def test_a_workflow_in_two_processes_matches_one_process(tmp_path):
    """A workflow's episodes in two processes: each runs its own tasks' episodes, whose calls come whenever the
    agent makes them and whose counts differ, while both sample in rounds they join together (a process whose
    episodes are done samples empty ones). The run equals one process of 4 devices."""
    agent = tmp_path / "agent.py"
    agent.write_text(VARYING_AGENT)
    mt = "actor_rollout_ref.rollout.multi_turn."
    overrides = {mt + "enable": True, mt + "workflow": f"{agent}:solve", mt + "max_tokens_per_turn": 6,
                 "data.max_response_length": 120, "data.prompt_template": "native", "data.max_prompt_length": 64,
                 "trainer.total_training_steps": 2, "mesh.data": -1, "mesh.fsdp": 1, "mesh.tensor": 1,
                 "trainer.logger": ("jsonl",)}
    one, two = _one_and_two_processes(tmp_path, 2, "grpo", **overrides)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    assert any(r["multi_turn/num_turns/max"] > r["multi_turn/num_turns/mean"] for r in one)  # episodes of many lengths
    for a, b in zip(one, two):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
                    "multi_turn/env_reward/mean", "multi_turn/num_turns/mean", "multi_turn/num_turns/max",
                    "multi_turn/masked_token_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
