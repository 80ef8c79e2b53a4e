"""Trinity-RFT's own example files (tests/config/dialects/trinity, unedited; SOURCE.md names their commit): GRPO,
SFT (mode: train on chat messages) and DPO (mode: train on prompt/chosen/rejected pairs, with Trinity's KL loss)
map onto our keys, run 2 steps with only shrinking overrides, and `convert` prints a file in our keys that runs to
the same first-step metrics."""

import os

import pytest

from rlhf_jax.config.__main__ import convert
from rlhf_jax.config.yaml_import import load_yaml
from tests.config import trinity_runs as R
from tests.train.helpers import read_metrics

HERE = os.path.join(os.path.dirname(__file__), "dialects", "trinity")
GRPO, SFT, DPO = (os.path.join(HERE, f) for f in ("gsm8k.yaml", "sft.yaml", "dpo.yaml"))


def test_grpo_example_maps_its_keys(monkeypatch):
    monkeypatch.delenv("TRINITY_TASKSET_PATH", raising=False)
    cfg = load_yaml(GRPO)
    d, arr = cfg.data, cfg.actor_rollout_ref
    # path openai/gsm8k with subset_name main: the Hub dataset, split by the taskset's split
    assert d.train_files == ("hf:openai/gsm8k?subset=main",) and d.train_split == "train"
    assert d.val_files == ("hf:openai/gsm8k?subset=main",) and d.val_split == "test"
    assert (d.max_prompt_length, d.max_response_length) == (1024, 1024)  # max_model_len - max_response_tokens
    assert cfg.algorithm.adv_estimator == "grpo" and arr.rollout.n == 8 and d.train_batch_size == 96
    # Trinity's GRPO default KL loss: k2 (verl's mse) with kl_coef 0.001
    assert (arr.actor.use_kl_loss, arr.actor.kl_loss_type, arr.actor.kl_loss_coef) == (True, "mse", 0.001)


def test_sft_example_is_the_sft_trainer_on_messages():
    cfg = load_yaml(SFT)
    d = cfg.data
    assert cfg.algorithm.type == "sft" and d.train_batch_size == 32  # batch_size x repeat_times (1)
    assert d.train_files == ("hf:open-r1/Mixture-of-Thoughts?subset=math",) and d.train_split == "train"
    # messages, not concatenated: the loss on each conversation's final assistant message
    assert (d.multiturn.enable, d.multiturn.messages_key, d.multiturn.train_on) == (True, "messages", "last")
    assert cfg.experience.buffer_size == 1  # sync_interval means nothing without an explorer


def test_dpo_example_is_the_dpo_trainer_with_trinitys_kl_loss(monkeypatch):
    monkeypatch.setenv("TRINITY_TASKSET_PATH", "/data/human_like")
    cfg = load_yaml(DPO)
    d, arr, dpo = cfg.data, cfg.actor_rollout_ref, cfg.algorithm.dpo
    assert cfg.algorithm.type == "dpo" and d.train_files == ("/data/human_like",)
    assert (d.prompt_key, d.chosen_key, d.rejected_key) == ("prompt", "chosen", "rejected")
    assert (d.train_batch_size, arr.actor.ppo_mini_batch_size) == (64, 64)  # train_batch_size pairs, one step
    assert (dpo.beta, dpo.kl_loss_type, dpo.kl_loss_coef) == (0.1, "kl", 0.1)  # kl_loss_fn k1, kl_coef 0.1
    assert (d.max_prompt_length, d.max_response_length) == (512, 1024)  # max_model_len 1536 - 1024
    assert arr.actor.ppo_micro_batch_size_per_gpu == 2  # trainer.trainer_config: verl keys, ours
    assert (arr.actor.optim.lr, arr.actor.optim.warmup_style, tuple(arr.actor.optim.betas)) == (5e-7, "cosine",
                                                                                             (0.9, 0.95))
    assert not arr.model.use_remove_padding
    # no kl_loss_fn (or none): Trinity's DPO uses k2 with its default coefficient
    base = "mode: train\nalgorithm:\n  algorithm_type: dpo\nbuffer:\n  train_batch_size: 4\n  trainer_input:\n" \
           "    experience_buffer:\n      path: /p\n"
    plain = load_yaml(base).algorithm.dpo
    assert (plain.kl_loss_type, plain.kl_loss_coef) == ("mse", 0.001)


def test_mode_and_dataset_refusals_name_the_key():
    head = "mode: train\nalgorithm:\n  algorithm_type: {}\nbuffer:\n  train_batch_size: 4\n  trainer_input:\n" \
           "    experience_buffer:\n      path: /p\n"
    for text, key in [
        (head.format("grpo"), r"mode='train': with algorithm\.algorithm_type='grpo': mode train runs sft or dpo"),
        (head.format("dpo").replace("mode: train", "mode: both"), r"mode='both': .*trains from a dataset"),
        (head.format("sft").replace("mode: train", "mode: explore"), r"mode='explore': use both"),
        (head.format("sft") + "      storage_type: queue\n", r"experience_buffer.*storage_type='queue'"),
        (head.format("sft") + "      format:\n        system_prompt_key: sys\n", r"format\.system_prompt_key='sys'"),
        (head.format("dpo\n  policy_loss_fn: ppo"), r"policy_loss_fn='ppo': .*policy_loss_fn dpo"),
        (head.format("sft\n  entropy_loss_fn: default\n  entropy_loss_fn_args:\n    entropy_coef: 0.1"),
         r"entropy_loss_fn='default': .*no entropy bonus"),
        (head.format("sft\n  kl_loss_fn: k3"), r"kl_loss_fn='k3': algorithm_type sft has no kl loss"),
    ]:
        with pytest.raises(ValueError, match=key):
            load_yaml(text)
    plaintext = load_yaml(head.format("sft") + "      split: validation\n      format:\n        prompt_type: "
                          "plaintext\n        prompt_key: q\n        response_key: a\n        system_prompt: Be brief\n")
    d = plaintext.data
    assert (d.prompt_key, d.response_key, d.system_prompt, d.train_split, d.multiturn.enable) == (
        "q", "a", "Be brief", "validation", False)


_SHRINK = {"actor_rollout_ref.model.path": "builtin:tiny", "trainer.total_training_steps": 2,
           "trainer.n_gpus_per_node": 1}  # cluster.gpu_per_node: 8; these runs have one device


def _grpo(tmp_path, out):
    return {**_SHRINK, "data.train_files": "builtin:arithmetic?max_value=4&train_size=16",
            "data.val_files": "builtin:arithmetic?max_value=4&test_size=4", "data.prompt_key": "prompt",
            "data.ground_truth_key": "reward_model.ground_truth", "data.max_prompt_length": 48,
            "data.max_response_length": 4, "data.train_batch_size": 4, "data.val_batch_size": 4,
            "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
            "trainer.default_local_dir": out}, {}


def _sft(tmp_path, out):
    data = R.conversations(str(tmp_path / "chats.jsonl"))
    return {**_SHRINK, "data.train_files": data, "data.max_prompt_length": 48, "data.max_response_length": 16,
            "data.train_batch_size": 4, "trainer.default_local_dir": out}, {}


def _dpo(tmp_path, out):
    data = R.pairs(str(tmp_path / "pairs.jsonl"))
    return {**_SHRINK, "data.max_prompt_length": 32, "data.max_response_length": 8, "data.train_batch_size": 4,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "trainer.default_local_dir": out}, \
        {"TRINITY_TASKSET_PATH": data}


@pytest.mark.parametrize("name,path,setup", [("grpo", GRPO, _grpo), ("sft", SFT, _sft), ("dpo", DPO, _dpo)])
def test_example_runs_two_steps_and_its_conversion_reads_the_same(tmp_path, monkeypatch, name, path, setup):
    out = str(tmp_path / "run")
    overrides, env = setup(tmp_path, out)
    proc = R.run_file(path, overrides, env=env)
    R.ran_two_steps(proc, out, "trinity")
    if name == "dpo":  # Trinity's DPO trains with its KL loss to the reference (k1, kl_coef 0.1): zero at the first
        # step (the policy is the reference), not after an update
        first, second = (row for row in read_metrics(out) if "actor/kl_loss" in row)
        assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6) and second["actor/kl_loss"] != 0.0
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    converted = tmp_path / "converted.yaml"
    converted.write_text(convert(path))
    R.assert_same_settings(path, str(converted), overrides)


def _with_stages(tmp_path) -> str:
    """The GRPO example with its commented-out stages switched on (an SFT warm-up, then the file's own RFT)."""
    import re

    with open(GRPO) as f:
        text = f.read()
    assert "# stages:" in text
    text = re.sub(r"^# (stages:).*$", r"\1", text, flags=re.M)
    text = re.sub(r"^# (  .*)$", r"\1", text, flags=re.M)
    path = tmp_path / "staged.yaml"
    path.write_text(text)
    return str(path)


def test_the_examples_stages_become_ours_and_each_stage_checks(tmp_path, monkeypatch):
    from rlhf_jax.train.stages import stage_configs

    monkeypatch.setenv("TRINITY_SFT_DATASET_PATH", R.conversations(str(tmp_path / "sft.jsonl")))
    cfg = load_yaml(_with_stages(tmp_path))
    sft, rft = cfg.stages
    # the SFT warm-up: Trinity's train mode on its own buffer (its steps and batch), the taskset not read
    assert sft["stage_name"] == "sft_warmup" and sft["algorithm.type"] == "sft"
    assert sft["data.train_files"] == (str(tmp_path / "sft.jsonl"),) and sft["data.train_batch_size"] == 128
    assert sft["trainer.total_training_steps"] == 10 and sft["data.multiturn.enable"]
    assert rft == {"stage_name": "rft"}  # "leave empty to use the original configs"
    cfg.actor_rollout_ref.model.path = "builtin:tiny"
    cfg.data.train_files = cfg.data.val_files = ("builtin:arithmetic?max_value=4&train_size=16&test_size=4",)
    cfg.data.max_prompt_length, cfg.data.max_response_length = 48, 8
    stages = stage_configs(cfg)  # every stage finalized, as before a staged run starts
    assert [name for name, _, _ in stages] == ["sft_warmup", "rft"]
    assert stages[0][2].algorithm.type == "sft" and stages[1][2].algorithm.adv_estimator == "grpo"
