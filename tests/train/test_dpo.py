"""DPO runs: sequence log-probs against transformers, a CLI run that learns the preferences, exact resume, LoRA
with the base as the reference (no second copy), and bad input stopping before any compilation."""

from __future__ import annotations

import gc
import json
import os
import signal

import jax
import numpy as np
import pytest
from flax import nnx

from rlhf_jax.models import lora
from rlhf_jax.train import dpo
from rlhf_jax.parallel.hosts import to_global
from rlhf_jax.train.dpo import DPOTrainer
from rlhf_jax.runtime.preemption import StopRequest
from tests.train.helpers import cli_args, load_recipe, read_metrics, run_main, tiny_hf_checkpoint
from tests.train.test_resume import _assert_same_rows

# 8 pairs per step on the test process's 8 devices (data 2 x fsdp 2 x tensor 2: 2 pairs per data-parallel shard),
# two optimizer steps of 4 pairs per step, micro-batches of one pair per shard.
FAST = {
    "data.train_files": ("builtin:arithmetic_preferences?max_value=4&train_size=64",),
    "data.val_files": ("builtin:arithmetic_preferences?max_value=4&test_size=6",),
    "data.train_batch_size": 8,
    "data.val_batch_size": 4,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 1,
    "trainer.total_training_steps": 4,
    "trainer.test_freq": 0,
    "trainer.val_before_train": False,
    "trainer.save_hf_checkpoint": "never",
    "trainer.logger": ("jsonl",),
    "mesh.data": 2,
    "mesh.fsdp": 2,
    "mesh.tensor": 2,
}


def make_config(out_dir: str, **overrides):
    cfg = load_recipe("dpo")
    for path, value in {**FAST, "trainer.default_local_dir": out_dir, **overrides}.items():
        node = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def _write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


# Strings and chat messages, responses of different lengths (so padding and masks matter).
PAIRS = [
    {"prompt": "What is 2+2?", "chosen": "4", "rejected": "It is five, I think."},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
     "chosen": [{"role": "assistant", "content": "Blue."}], "rejected": [{"role": "assistant", "content": "Tuesday"}]},
    {"prompt": "Say hi", "chosen": "hi there, friend", "rejected": "no"},
    {"prompt": [{"role": "user", "content": "Capital of France?"}], "chosen": "Paris",
     "rejected": [{"role": "assistant", "content": "Rome, of course."}]},
    {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
    {"prompt": "Spell cat", "chosen": "c-a-t", "rejected": "k-a-t"},
    {"prompt": "Opposite of up?", "chosen": "down", "rejected": "sideways or so"},
    {"prompt": "Last letter of the alphabet", "chosen": "z", "rejected": "a"},
]


def _torch_sequence_log_probs(model_dir, prompt_ids, response_ids):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, r in zip(prompt_ids, response_ids):
            ids = torch.tensor(np.concatenate([p, r])[None], dtype=torch.long)
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            token = logp.gather(-1, ids[0, 1:, None])[:, 0]
            out.append(float(token[-len(r):].sum()))
    return np.asarray(out)


def test_sequence_log_probs_match_transformers(tmp_path):
    """The trainer's summed response log-probs (policy and reference passes, padded batch layout, and the update's
    own forward) equal transformers' on the unpadded sequences."""
    import transformers

    model_dir = tiny_hf_checkpoint("LlamaConfig", "LlamaForCausalLM", str(tmp_path / "model"))
    data = _write_jsonl(tmp_path / "prefs.jsonl", PAIRS)
    cfg = make_config(str(tmp_path / "run"), **{
        "actor_rollout_ref.model.path": model_dir, "data.train_files": (data,), "data.val_files": (data,),
        "data.prompt_template": "native", "data.max_prompt_length": 64, "data.max_response_length": 32,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "data.val_batch_size": 3, "trainer.total_training_steps": 1, "trainer.save_freq": 0})
    trainer = DPOTrainer(cfg)
    ds = trainer.train_data
    # Chat responses are the template's continuation of the prompt: prompt + response == the whole conversation.
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    full = tok.apply_chat_template(PAIRS[1]["prompt"] + PAIRS[1]["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert list(ds.prompts.input_ids[1]) + list(ds.chosen[1]) == list(full)
    assert tok.decode(ds.chosen[0]) == "4<|im_end|>\n"  # a string response under native: one assistant turn

    rows = np.arange(len(PAIRS))
    batch = {k: to_global(trainer.mesh, v) for k, v in trainer._host_pairs(ds, rows, "train").items()}
    want = {}
    for s in ("chosen", "rejected"):
        want[s] = _torch_sequence_log_probs(model_dir, ds.prompts.input_ids, getattr(ds, s))
        for role in (trainer.actor, trainer.ref):
            got = np.asarray(trainer._sequence_log_probs(role, batch, s, 2))
            np.testing.assert_allclose(got, want[s], rtol=1e-5, atol=2e-4, err_msg=s)
    # Validation in batches of 3, 3 and 2 pairs (each padded to whole shards; padding pairs are not counted).
    val = trainer.validate(0)
    np.testing.assert_allclose(val["val/logps/chosen"], want["chosen"].mean(), rtol=1e-5, atol=2e-4)
    np.testing.assert_allclose(val["val/logps/rejected"], want["rejected"].mean(), rtol=1e-5, atol=2e-4)
    assert val["val/rewards/margins"] == 0 and val["val/rewards/accuracies"] == 0  # policy == reference
    assert val["val/dpo_loss"] == pytest.approx(np.log(2), abs=1e-6)
    # One step over the whole set: the update's forward (before its optimizer step) gives the same means.
    metrics = trainer.fit()
    np.testing.assert_allclose(metrics["logps/chosen"], want["chosen"].mean(), rtol=1e-5, atol=2e-4)
    np.testing.assert_allclose(metrics["logps/rejected"], want["rejected"].mean(), rtol=1e-5, atol=2e-4)
    assert abs(metrics["rewards/margins"]) < 1e-4 and metrics["actor/dpo_loss"] == pytest.approx(np.log(2), abs=1e-5)


def test_cli_run_learns_the_preferences(tmp_path):
    out = str(tmp_path / "run")
    args = [f"--config={os.path.join(os.path.dirname(__file__), '..', '..', 'configs', 'dpo.py')}",
            f"--config.trainer.default_local_dir={out}", "--config.trainer.total_training_steps=24",
            "--config.trainer.test_freq=24", "--config.trainer.save_freq=24", "--config.trainer.logger=('jsonl',)",
            "--config.trainer.save_hf_checkpoint=never"]
    proc = run_main(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip() == ""  # nothing but the console's metric lines (stdout)
    rows = read_metrics(out)
    before, steps = rows[0], rows[1:]
    assert before["step"] == 0 and before["val/rewards/accuracies"] == 0.0  # policy == reference: all ties
    assert [r["step"] for r in steps] == list(range(1, 25))
    assert steps[0]["actor/dpo_loss"] == pytest.approx(np.log(2), abs=1e-4)
    late = [r["rewards/accuracies"] for r in steps[-6:]]
    assert np.mean(late) > 0.5, late
    assert steps[-1]["val/rewards/accuracies"] > 0.5 and steps[-1]["val/rewards/margins"] > 0
    assert steps[-1]["actor/dpo_loss"] < np.log(2) and steps[-1]["rewards/chosen"] > steps[-1]["rewards/rejected"]
    assert os.path.isdir(os.path.join(out, "checkpoints", "24"))


def test_stop_signal_and_resume_are_exact(tmp_path):
    """SIGTERM during step 2 of 4 ends the run after that step with a checkpoint (none was scheduled there); the same
    command resumes and its steps 3-4 and final weights equal the uninterrupted run's."""
    full_dir, split_dir = str(tmp_path / "full"), str(tmp_path / "split")
    over = {"trainer.save_freq": 3, "trainer.test_freq": 2, "actor_rollout_ref.actor.shuffle": True}
    full = DPOTrainer(make_config(full_dir, **over), stop=StopRequest())
    full.fit()
    stopped = DPOTrainer(make_config(split_dir, **over), stop=StopRequest())
    step = stopped.step

    def signalled(n):
        if stopped.loop.step == 1:  # inside step 2
            os.kill(os.getpid(), signal.SIGTERM)
        return step(n)

    stopped.step = signalled
    stopped.fit()
    assert stopped.loop.step == 2 and stopped.loop.checkpoints.complete_steps() == [2]
    resumed = DPOTrainer(make_config(split_dir, **over), stop=StopRequest())
    resumed.fit()
    full_rows, split_rows = read_metrics(full_dir), read_metrics(split_dir)
    assert [r["step"] for r in split_rows] == [1, 2, 3, 4]
    for step_no in (3, 4):
        _assert_same_rows(full_rows[step_no - 1], split_rows[step_no - 1])
    assert full_rows[2]["actor/dpo_loss"] != full_rows[3]["actor/dpo_loss"] and "val/rewards/accuracies" in full_rows[3]
    for a, b in zip(jax.tree.leaves(full.actor.params), jax.tree.leaves(resumed.actor.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _host(state) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def test_lora_reference_is_the_base_without_a_second_copy(tmp_path):
    gc.collect()
    before_copies = sum(1 for x in jax.live_arrays() if x.shape == (264, 64))
    trainer = DPOTrainer(make_config(str(tmp_path / "run"), **{
        "actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.lora_alpha": 8.0,
        "actor_rollout_ref.actor.optim.lr": 2e-2, "trainer.total_training_steps": 2, "trainer.save_freq": 0}))
    gc.collect()
    assert sum(1 for x in jax.live_arrays() if x.shape == (264, 64)) - before_copies == 1  # one embedding table
    frozen, ref = jax.tree.leaves(trainer.actor.frozen), jax.tree.leaves(trainer.ref.state())
    assert {id(x) for x in ref} == {id(x) for x in frozen}
    start = _host(trainer.actor.state())
    metrics = trainer.fit()
    after = _host(trainer.actor.state())
    for path, value in start.items():
        if not lora.is_adapter(path):
            np.testing.assert_array_equal(after[path], value, err_msg=str(path))
    assert any(not np.array_equal(after[p], start[p]) for p in start if lora.is_adapter(p))
    assert set(_host(trainer.actor.params)) == {p for p in start if lora.is_adapter(p)}
    assert metrics["rewards/margins"] != 0  # the adapters moved the policy away from the reference (the base)


def test_missing_rejected_stops_before_compiling_naming_file_and_row(tmp_path):
    rows = [dict(PAIRS[0]), {"prompt": "2+2=", "chosen": "4"}, dict(PAIRS[2])]
    data = _write_jsonl(tmp_path / "prefs.jsonl", rows)
    args = cli_args(str(tmp_path / "run"), "dpo")[:1] + [
        f"--config.trainer.default_local_dir={tmp_path / 'run'}", f"--config.data.train_files=('{data}',)",
        f"--config.data.val_files=('{data}',)"]
    proc = run_main(args, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert f"{data} row 1: missing column 'rejected' (data.rejected_key)" in line, line


@pytest.mark.parametrize("overrides,message", [
    ({"algorithm.dpo.loss_type": "robust"}, r"algorithm\.dpo\.loss_type='robust' is not valid; choose from sigmoid"),
    ({"algorithm.dpo.beta": 0.0}, r"algorithm\.dpo\.beta=0\.0 must be > 0"),
    ({"algorithm.dpo.label_smoothing": 0.5}, r"algorithm\.dpo\.label_smoothing=0\.5 must be in \[0, 0\.5\)"),
    ({"algorithm.dpo.loss_type": "ipo", "algorithm.dpo.label_smoothing": 0.1}, r"applies to loss_type=sigmoid"),
    ({"actor_rollout_ref.rollout.n": 2}, r"actor_rollout_ref\.rollout\.n=2 is a setting of the RL loop, which "
                                         r"algorithm\.type=dpo does not run: leave it at its default \(1\)"),
    ({"actor_rollout_ref.actor.use_kl_loss": True}, r"actor_rollout_ref\.actor\.use_kl_loss=True is a setting of"),
    ({"algorithm.adv_estimator": "grpo"}, r"algorithm\.adv_estimator='grpo' is a setting of the RL loop"),
    ({"critic.enable": True}, r"critic\.enable=True is a setting of the RL loop"),
    ({"experience.buffer_size": 2}, r"experience\.buffer_size=2 is a setting of the RL loop"),
    ({"actor_rollout_ref.model.use_remove_padding": True}, r"use_remove_padding=True: DPO runs padded batches"),
    ({"data.chosen_key": "better"}, r"row 0: missing column 'better' \(data\.chosen_key\)"),
])
def test_bad_settings_stop_before_loading(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        dpo.prepare(make_config(str(tmp_path / "run"), **overrides))


def test_micro_batches_do_not_change_the_step(tmp_path):
    """One SGD step (lr 1: the parameter change is the gradient) over 8 pairs in one pass or in micro-batches of one
    pair per shard gives the same weights and metrics."""
    results = []
    for micro in (-1, 1):
        trainer = DPOTrainer(make_config(str(tmp_path / f"micro{micro}"), **{
            "actor_rollout_ref.actor.ppo_mini_batch_size": 8, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro,
            "actor_rollout_ref.actor.optim.optimizer": "SGD", "actor_rollout_ref.actor.optim.lr": 1.0,
            "actor_rollout_ref.actor.optim.weight_decay": 0.0, "actor_rollout_ref.actor.grad_clip": 0.0,
            "trainer.total_training_steps": 2, "trainer.save_freq": 0}))
        assert trainer.cfg.derived.actor_grad_accum_steps == (1 if micro == -1 else 2)
        metrics = trainer.fit()
        results.append((metrics, [np.asarray(x) for x in jax.tree.leaves(trainer.actor.params)]))
    (m1, p1), (m2, p2) = results
    assert m1["actor/grad_norm"] > 0 and m1["rewards/margins"] != 0  # the second step sees the first one's change
    for name in ("actor/dpo_loss", "actor/grad_norm", "rewards/margins", "rewards/chosen", "logps/rejected"):
        np.testing.assert_allclose(m1[name], m2[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for a, b in zip(p1, p2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
