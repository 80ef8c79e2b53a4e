"""A run whose sampling and training happen on different processes (mesh.rollout_processes): four processes of
two fake CPU devices over gloo, two sampling and two training, train like one process of eight devices with
mesh.rollout_devices=4 and experience.overlap (the same schedule: batch k sampled with the weights of update
k - 1), step for step, to the same weights."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest

from rlhf_jax.models.safetensors_io import LazyFile
from tests.train.helpers import Processes, cli_args, read_metrics, run_main

STEPS = 4
COMMON = {"trainer.total_training_steps": STEPS, "trainer.save_hf_checkpoint": "last", "mesh.data": 2,
          "mesh.fsdp": 2, "mesh.tensor": 1, "experience.overlap": True, "trainer.logger": ("jsonl",)}
KEYS = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
        "actor/grad_norm")
_MT = "actor_rollout_ref.rollout.multi_turn."
GAME = {_MT + "enable": True, _MT + "environment": "guess_number", _MT + "max_assistant_turns": 3,
        _MT + "max_tokens_per_turn": 6, "data.max_response_length": 80, "data.prompt_template": "native",
        "data.max_prompt_length": 160,
        "data.train_files": ("builtin:guess_number?max_value=3&max_steps=3&train_size=16",),
        "data.val_files": ("builtin:guess_number?max_value=3&max_steps=3&test_size=4",)}  # the guessing game


def _launch(out: str, recipe: str = "grpo", **overrides) -> Processes:
    """The four processes, as launch/local_multiprocess.sh 4 2 starts them."""
    args = cli_args(out, recipe, **{**COMMON, "mesh.rollout_processes": 2, "mesh.handoff_timeout_s": 120.0,
                                    **overrides})
    return Processes(4, 2, args)


def _split_run(out: str, timeout: float = 600, recipe: str = "grpo", **overrides) -> subprocess.CompletedProcess:
    with _launch(out, recipe, **overrides) as procs:
        stdout, stderr = procs.communicate(timeout=timeout)
    return subprocess.CompletedProcess(["rlhf_jax.main"], procs.returncode, stdout, stderr)


def _weights(out: str) -> LazyFile:
    return LazyFile(os.path.join(out, "hf", f"global_step_{STEPS}", "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process of 8 devices, 4 of them sampling, with overlap: the run a split run must equal."""
    out = str(tmp_path_factory.mktemp("single"))
    proc = run_main(cli_args(out, **{**COMMON, "mesh.rollout_devices": 4}), devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_two_sampling_and_two_training_processes_train_like_one_process_with_overlap(tmp_path):
    """On a Mixture-of-Experts actor whose updates replay the sampler's expert choices (router_replay.mode=R3):
    the expert ids travel with each batch. The sampler holds bfloat16 weights, so its choices differ from the
    float32 passes' own on some tokens, and a batch that lost them would train differently."""
    from tests.train.helpers import tiny_hf_checkpoint

    moe = tiny_hf_checkpoint("Qwen3MoeConfig", "Qwen3MoeForCausalLM", str(tmp_path / "moe"), num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                             initializer_range=0.1)
    settings = {"actor_rollout_ref.model.path": moe, "actor_rollout_ref.actor.router_replay.mode": "R3",
                "actor_rollout_ref.rollout.weight_dtype": "bfloat16"}
    single, split = str(tmp_path / "single"), str(tmp_path / "split")
    proc = run_main(cli_args(single, **{**COMMON, **settings, "mesh.rollout_devices": 4}), devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _split_run(split, **settings)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = read_metrics(single), read_metrics(split)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two):
        for key in (*KEYS, "training/rollout_probs_diff_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    assert one[-1]["actor/grad_norm"] > 0
    reference = _weights(single)
    model_bytes = sum(reference.get(name).nbytes for name in reference.keys())
    sent = [r["split/weight_bytes_sent"] for r in two[:-1]]  # all of them, as bfloat16 copies: half the bytes
    assert all(model_bytes // 2 <= s < model_bytes for s in sent), (sent, model_bytes)
    for name in reference.keys():
        np.testing.assert_allclose(_weights(split).get(name), reference.get(name), rtol=1e-6, atol=1e-6, err_msg=name)


def test_two_sampling_processes_play_the_conversations_together_like_one_process(tmp_path):
    """The guessing game's conversations sampled by two processes (each plays its own prompts' games; they agree
    on every program the conversations run) while two others train: like one process with rollout devices."""
    single, split = str(tmp_path / "single"), str(tmp_path / "split")
    proc = run_main(cli_args(single, **{**COMMON, **GAME, "mesh.rollout_devices": 4}), devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _split_run(split, **GAME)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = read_metrics(single), read_metrics(split)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two):
        assert 0 < b["multi_turn/masked_token_fraction"] < 1  # the game's replies between the turns
        for key in (*KEYS, "multi_turn/num_turns/mean", "multi_turn/env_reward/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    reference = _weights(single)
    for name in reference.keys():
        np.testing.assert_allclose(_weights(split).get(name), reference.get(name), rtol=1e-6, atol=1e-6, err_msg=name)


def _rows(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    return sum(1 for line in open(path) if line.endswith("\n")) if os.path.exists(path) else 0


def _sigterm_after(out: str, rows: int, **overrides) -> int:
    """Start the run, SIGTERM every process once ``rows`` steps are logged, and return the steps it finished (it
    stops at the next step boundary, or abandons the step in flight before its update)."""
    with _launch(out, **overrides) as procs:
        deadline = time.monotonic() + 500
        while _rows(out) < rows and procs.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procs.poll() is None, procs.communicate()[1][-3000:]
        for pid in procs.pids:
            os.kill(pid, signal.SIGTERM)
        _, stderr = procs.communicate(timeout=300)
    assert procs.returncode == 0, stderr[-3000:]
    return _rows(out)


def _launch_each(out: str, **overrides) -> list:
    """The four processes, each with its own stderr file (``<out>.<i>.err``), and heartbeats of 30 s: a silent
    peer is called gone after 12 s (parallel/watchdog.py)."""
    args = cli_args(out, **{**COMMON, "mesh.rollout_processes": 2, "mesh.handoff_timeout_s": 300.0, **overrides})
    return Processes(4, 2, args, env={"RLHF_JAX_HEARTBEAT_TIMEOUT_S": "30"}, files=out).procs


def _kill_after(out: str, rows: int, victim: int, **overrides) -> dict[int, tuple[int, float]]:
    """Start the run, SIGKILL process ``victim`` once ``rows`` steps are logged (batches and weights move between
    the groups at every step), and return each other process's (exit code, seconds from the kill to its exit)."""
    procs = _launch_each(out, **overrides)
    try:
        deadline = time.monotonic() + 500
        while _rows(out) < rows and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.poll() is None for p in procs), [open(f"{out}.{i}.err").read()[-2000:] for i in range(4)]
        procs[victim].kill()
        killed, exits = time.monotonic(), {}
        while len(exits) < 3 and time.monotonic() - killed < 120:
            for i, p in enumerate(procs):
                if i != victim and i not in exits and p.poll() is not None:
                    exits[i] = (p.returncode, time.monotonic() - killed)
            time.sleep(0.05)
        return exits
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_a_killed_process_stops_every_other_in_one_line_and_the_run_resumes(tmp_path, reference):
    """SIGKILL a sampling process, rerun, SIGKILL a training process, rerun: each time every other process exits
    within 60 s with one line naming the process gone; each rerun resumes from the last checkpoint, and the
    weights at the end are the uninterrupted run's (the checkpoints and their pending batches survived)."""
    out = str(tmp_path / "split")
    for rows, victim in ((1, 3), (2, 1)):
        exits = _kill_after(out, rows, victim, **{"trainer.save_freq": 1})
        assert sorted(exits) == sorted({0, 1, 2, 3} - {victim}), exits
        for process, (code, seconds) in exits.items():
            err = open(f"{out}.{process}.err").read()
            lines = [line for line in err.splitlines() if "error: " in line]
            assert code == 2 and seconds < 60, (process, code, seconds, err[-2000:])
            assert len(lines) == 1 and f"process {victim} stopped responding" in lines[0], (process, err[-2000:])
    proc = _split_run(out, **{"trainer.save_freq": 1})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))
    expected = _weights(reference)
    for name in expected.keys():
        np.testing.assert_allclose(_weights(out).get(name), expected.get(name), rtol=1e-6, atol=1e-6, err_msg=name)


LORA = {"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.lora_alpha": 8.0,
        "actor_rollout_ref.actor.optim.lr": 2e-2}


def test_under_lora_with_a_reward_model_only_the_adapters_move_and_the_run_trains_like_one_process(tmp_path):
    """The sampling side keeps the base weights and merges each update's adapters in itself: after the first
    sync (the base weights are read from the checkpoint on both sides) the adapters alone move. The responses are
    scored where they are sampled, by a reward model on the sampling devices. The run trains like one process
    with mesh.rollout_devices and overlap."""
    from tests.train.helpers import tiny_hf_checkpoint

    rm = tiny_hf_checkpoint("LlamaConfig", "LlamaForSequenceClassification", str(tmp_path / "rm"), num_labels=1)
    settings = {**LORA, "reward_model.enable": True, "reward_model.model.path": rm,
                "reward_model.micro_batch_size_per_gpu": 1, "custom_reward_function.path": ""}
    single, split = str(tmp_path / "single"), str(tmp_path / "split")
    proc = run_main(cli_args(single, **{**COMMON, **settings, "mesh.rollout_devices": 4}), devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _split_run(split, **settings)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = read_metrics(single), read_metrics(split)
    assert len({r["critic/score/mean"] for r in one}) == STEPS  # the reward model's scores, not a constant rule
    for a, b in zip(one, two):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    model = _weights(single)
    model_bytes = sum(model.get(name).nbytes for name in model.keys())
    sent = [r["split/weight_bytes_sent"] for r in two]  # the last step has no next batch to send weights for
    assert all(0 < s < 0.1 * model_bytes for s in sent[:-1]) and sent[-1] == 0, (sent, model_bytes)
    # the reward model pads each process's rows to reward_model.max_length in a split run (to a power of two in one
    # process), so its scores differ in the last float bits, and four LoRA updates at lr 2e-2 carry that to ~1e-6
    for name in model.keys():
        np.testing.assert_allclose(_weights(split).get(name), model.get(name), rtol=1e-6, atol=1e-5, err_msg=name)


def test_partial_rollouts_carry_two_versions_per_sequence_and_train(tmp_path):
    """experience.partial_rollout_tokens=2 of 4 with partial_rollout_wait: every batch after the first is
    sampled 2 tokens with the weights before the update that trains meanwhile and the rest with that update's
    weights (re-prefilled); per-token versions reach the training side, which corrects with rollout_is. The
    context split is left automatic (the recipe's default): the training processes agree on it among themselves.
    Then SIGTERM to every process while step 2 runs: the training side stops at a step boundary with the next
    batch in its checkpoint (or abandons the step before its update) and tells the sampling side to stop; the same
    command resumes, and the remaining steps and the final weights are the uninterrupted run's."""
    out = str(tmp_path / "split")
    partial = {"experience.partial_rollout_tokens": 2, "experience.partial_rollout_wait": True,
               "algorithm.rollout_correction.rollout_is": "token", "mesh.context": 0, "trainer.save_freq": STEPS}
    proc = _split_run(out, **partial)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first, later = rows[0], rows[1:]
    assert first["rollout/segment_versions"] == 1 and first["training/staleness_max"] == 0
    assert first["rollout/partial_fraction"] == 0
    for r in later:  # batch s: its first tokens from version s - 1, the rest from version s (π_old: no lag)
        assert r["rollout/segment_versions"] == 2, r
        assert r["training/weight_version"] == r["step"] - 2 and r["training/weight_version_newest"] == r["step"] - 1
        assert r["training/staleness_max"] == 1 and r["rollout/partial_fraction"] > 0, r
        assert np.isfinite(r["rollout_corr/rollout_is_mean"]) and np.isfinite(r["actor/pg_loss"]), r
    assert all(r["split/weight_bytes_sent"] > 0 for r in rows[:-1])  # each update, offered as soon as made
    # stopped while step 2 runs (abandoned before its update, or after it) and resumed: the same steps, exactly
    again = str(tmp_path / "stopped")
    stopped = _sigterm_after(again, 1, **partial)
    assert 1 <= stopped < STEPS
    proc = _split_run(again, **partial)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = read_metrics(again)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(rows[stopped:], resumed[stopped:]):
        for key in (*KEYS, "training/staleness_max", "rollout/partial_fraction", "rollout_corr/rollout_is_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-8), (a["step"], key)
    expected = _weights(out)
    for name in expected.keys():
        np.testing.assert_allclose(_weights(again).get(name), expected.get(name), rtol=1e-6, atol=1e-6, err_msg=name)


def test_dapo_with_a_distillation_teacher_trains_like_one_process(tmp_path):
    """DAPO's dynamic sampling (algorithm.filter_groups) in a split run: the sampling processes draw further prompt
    batches until the batch's groups vary and send the kept groups with the number of batches drawn, so the
    training processes' loader keeps pace. A distillation teacher (another checkpoint) scores the samples on the
    training side, in the reference's pass. Rounds of two batches (experience.buffer_size=2) with overlap: the
    first round is sampled before step 1, the second while step 1 trains, both with the starting weights. The run
    trains like one process with rollout devices and the same schedule."""
    from tests.train.helpers import tiny_hf_checkpoint
    from tests.train.test_verl_semantics import HALF_FLAT_REWARD

    reward = tmp_path / "reward.py"
    reward.write_text(HALF_FLAT_REWARD)
    teacher = tiny_hf_checkpoint("LlamaConfig", "LlamaForCausalLM", str(tmp_path / "teacher"),
                                 intermediate_size=128, initializer_range=0.2)
    dapo = {"custom_reward_function.path": str(reward), "algorithm.filter_groups.metric": "acc",
            "actor_rollout_ref.rollout.n": 4, "data.max_response_length": 8,
            "reward_model.overlong_buffer.enable": False, "distillation.enabled": True,
            "distillation.teacher_models.teacher_model.model_path": teacher,
            "distillation.distillation_loss.loss_mode": "k3", "distillation.distillation_loss.distillation_loss_coef": 0.5,
            "experience.buffer_size": 2}
    single, split = str(tmp_path / "single"), str(tmp_path / "split")
    proc = run_main(cli_args(single, "dapo", **{**COMMON, **dapo, "mesh.rollout_devices": 4}), devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _split_run(split, recipe="dapo", **dapo)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = read_metrics(single), read_metrics(split)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert all(r["train/num_gen_batches"] >= 2 for r in one)  # half the groups are flat: one batch never fills
    assert all(r["distillation/abs_loss"] > 0.01 for r in one)  # another model: a real divergence
    assert [r["training/weight_version"] for r in two] == [0, 0, 0, 0]  # two rounds, both before the first update
    for a, b in zip(one, two):
        keys = (*KEYS, "train/num_gen_batches", "distillation/loss", "distillation/abs_loss")
        for key in (k for k in keys if k in a or k in b):  # DAPO has no KL loss
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_multi_turn_conversations_in_one_sampling_process_train_like_one_process(tmp_path):
    """An environment's conversations (the guessing game: its replies appended between turns, untrained, and its
    rewards the scores) sampled by one process of four devices while another of four trains and validates, like
    one process of eight with four rollout devices, on-policy in rounds of two batches (no overlap,
    experience.buffer_size=2: the training process waits while a round is sampled with its weights). Both runs stop
    after 3 steps and resume from their checkpoints for a fourth (the lone training process's checkpoint holds host
    copies: Orbax writes no whole array in a multi-process run)."""
    game = {**GAME, "trainer.total_training_steps": 4, "experience.overlap": False, "experience.buffer_size": 2}
    single, split = str(tmp_path / "single"), str(tmp_path / "split")
    for steps in (3, 4):
        proc = run_main(cli_args(single, **{**COMMON, **game, "mesh.rollout_devices": 4,
                                            "trainer.total_training_steps": steps}), devices=8)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for steps in (3, 4):
        args = cli_args(split, **{**COMMON, **game, "mesh.rollout_processes": 1, "mesh.handoff_timeout_s": 120.0,
                                  "trainer.total_training_steps": steps})
        with Processes(2, 4, args) as procs:
            _, stderr = procs.communicate(timeout=600)
        assert procs.returncode == 0, stderr[-4000:]
    # the second commands resumed at step 3: a fresh start would have moved the first one's metrics aside
    assert not any(os.path.exists(os.path.join(out, "metrics.jsonl.1")) for out in (single, split))
    one, two = read_metrics(single), read_metrics(split)
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4]
    assert all(0 < r["multi_turn/masked_token_fraction"] < 1 for r in two)  # the game's replies, untrained
    # rounds of steps 1-2 and 3 (the first command ends there), then 4 in the resumed one: sampled when due
    assert [r["training/weight_version"] for r in two] == [0, 0, 2, 3]
    for a, b in zip(one, two):
        for key in (*KEYS, "multi_turn/env_reward/mean", "multi_turn/num_turns/mean", "val-core/guess_number/reward/mean@1"):
            if key in a or key in b:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
