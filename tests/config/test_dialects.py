"""Other trainers' config files (ROLL's rlvr_config.yaml, Trinity-RFT's; the TRL-based Trainer_config.yaml and
ATorch's in test_dialects_trl_atorch.py): each converts, round-trips through `convert`, trains two steps with only model, data and batch sizes
overridden; keys with no meaning are warned about once, keys whose value would change the run are refused by
name."""

import glob
import logging
import os

import pytest

from rlhf_jax.agents.settings import turn_settings
from rlhf_jax.config import finalize
from rlhf_jax.config.__main__ import convert
from rlhf_jax.config.yaml_import import load_yaml
from tests.train.helpers import run_main

ROLL = os.path.join(os.path.dirname(__file__), "dialects", "roll_rlvr.yaml")


def test_roll_file_maps_its_keys():
    cfg = load_yaml(ROLL)
    arr = cfg.actor_rollout_ref
    assert (cfg.data.train_batch_size, arr.rollout.n) == (64, 8)  # rollout_batch_size x num_return_sequences
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (2048, 4096)
    assert arr.model.path == "Qwen/Qwen2.5-7B" and arr.model.compute_dtype == "bfloat16"
    # per_device_train_batch_size 1 x gradient_accumulation_steps 32 x 16 training devices = 512 sequences
    assert arr.actor.ppo_mini_batch_size == 512 // 8 and arr.actor.ppo_micro_batch_size_per_gpu == 1
    # dual_clip_loss: ROLL bounds negative advantages' loss at 1 + 2 pg_clip
    assert (arr.actor.clip_ratio_low, arr.actor.clip_ratio_high) == (0.2, 0.28)
    assert arr.actor.clip_ratio_c == pytest.approx(1.4)
    # ROLL's grpo: the discounted return of group-normalised scores
    alg = cfg.algorithm
    assert (alg.adv_estimator, alg.reward_norm.mean, alg.reward_norm.std) == ("reinforce", "group", "group")
    assert (cfg.algorithm.lam, arr.actor.use_kl_loss, arr.actor.kl_loss_coef) == (0.95, True, 0.001)
    assert (arr.rollout.temperature, arr.rollout.top_p, arr.rollout.top_k) == (0.99, 0.99, 100)
    assert (arr.rollout.val_kwargs.temperature, arr.rollout.val_kwargs.top_k) == (0.6, 50)
    assert cfg.data.train_files == ("data/math_deepmath_deal.jsonl",) and cfg.data.prompt_key == "messages"
    t = cfg.trainer
    assert (t.total_training_steps, t.save_freq, t.test_freq, t.seed) == (500, 100, 10, 7)
    assert (t.experiment_name, t.project_name, t.resume_mode) == ("qwen-rlvr-math", "roll_math", "disable")
    assert t.n_gpus_per_node == 8  # num_gpus_per_node: the devices the run uses
    assert arr.model.enable_gradient_checkpointing  # disable_gradient_checkpointing: false


def test_roll_defaults_apply_where_the_file_is_silent():
    cfg = load_yaml("rollout_batch_size: 4\nresponse_length: 8\nadv_estimator: grpo\nnorm_mean_type: group\n")
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-mean"  # ROLL's default, not verl's
    assert cfg.algorithm.lam == 0.95 and cfg.actor_rollout_ref.actor.clip_ratio_c == 1e30  # no dual clip
    # ROLL's grpo normalises by the group's mean and std whatever norm_std_type says
    assert (cfg.algorithm.reward_norm.mean, cfg.algorithm.reward_norm.std) == ("group", "group")


def test_convert_output_gives_the_same_finalized_config(tmp_path):
    text = convert(ROLL)
    converted = tmp_path / "converted.yaml"
    converted.write_text(text)
    again = load_yaml(str(converted))
    assert "actor_train" not in text and "ppo_mini_batch_size: 64" in text
    a = finalize(load_yaml(ROLL), num_devices=8, check_paths=False, train_dataset_size=6400)
    b = finalize(again, num_devices=8, check_paths=False, train_dataset_size=6400)
    assert a.to_dict() == b.to_dict()


def test_roll_keys_without_meaning_are_warned_once_and_changing_ones_refused(caplog):
    with caplog.at_level(logging.WARNING, logger="rlhf_jax.config"):
        load_yaml(ROLL)
    warnings = [r.getMessage() for r in caplog.records if "roll keys have no meaning" in r.getMessage()]
    assert len(warnings) == 1 and "actor_infer.strategy_args" in warnings[0] and "logging_steps" in warnings[0]
    base = "rollout_batch_size: 4\nresponse_length: 8\nnorm_mean_type: group\n"
    for text, key in [
        ("profiler_timeline: true\n", r"profiler_timeline=True is not supported.*trainer\.profile_steps"),
        ("adv_estimator: gigpo\n", r"adv_estimator='gigpo'"),
        ("adv_estimator: reinforce\nnorm_mean_type: running\n", r"norm_mean_type='running'.*running statistics"),
        ("adv_estimator: gae\n", r"adv_estimator=gae.*whiten_advantages: true"),
        ("use_topr_loss: true\n", r"use_topr_loss=True is not supported"),
        ("actor_train:\n  model_args:\n    lora_target: .*proj\n", r"actor_train\.model_args\.lora_target=.*regular "
         r"expression"),
        ("rewards:\n  judge:\n    worker_cls: roll.pipeline.rlvr.rewards.llm_judge_reward_worker.W\n",
         r"rewards\.judge\.worker_cls"),
        ("my_setting: 3\n", r"my_setting \(roll key\) has no rlhf_jax equivalent"),
    ]:
        with pytest.raises(ValueError, match=key):
            load_yaml(base + text)


def test_format_recognised_or_named():
    # no ROLL marker in the file: --config_format says what it is
    cfg = load_yaml("max_steps: 3\nresponse_length: 8\nadv_estimator: grpo\nnorm_mean_type: group\n", fmt="roll")
    assert cfg.trainer.total_training_steps == 3
    # ATorch's files by their tokenizer / train sections or a model section listing its model names
    assert load_yaml("tokenizer:\n  tokenizer_path: /tok\ntrain:\n  epochs: 2\n").trainer.total_epochs == 2
    assert load_yaml("model:\n  actor:\n    model_path: /m\n").actor_rollout_ref.model.path == "/m"


def test_roll_file_trains_two_steps_with_overrides_in_our_keys(tmp_path):
    out = str(tmp_path / "run")
    overrides = {
        "actor_rollout_ref.model.path": "builtin:tiny",
        "data.train_files": "builtin:arithmetic?max_value=4&train_size=16",
        "data.val_files": "builtin:arithmetic?max_value=4&test_size=4",
        "data.prompt_key": "prompt", "data.max_prompt_length": 48, "data.max_response_length": 4,
        "data.train_batch_size": 4, "data.val_batch_size": 4, "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "trainer.total_training_steps": 2,
        "trainer.default_local_dir": out, "trainer.log_dir": out,  # the file's bfloat16 compute stays
        "trainer.n_gpus_per_node": 1,  # num_gpus_per_node: 8; this run has one device
    }
    args = [f"--config={ROLL}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
    proc = run_main(args, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("roll keys have no meaning in rlhf_jax") == 1
    assert os.path.isdir(os.path.join(out, "checkpoints", "2"))
    assert glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))  # track_with: tensorboard
    assert "step 2" in proc.stdout


def test_config_format_flag_on_the_command_line(tmp_path):
    from rlhf_jax.config import load_config_from_argv

    path = tmp_path / "run.yaml"
    path.write_text("max_steps: 3\nresponse_length: 8\nadv_estimator: grpo\nnorm_mean_type: group\n")
    cfg = load_config_from_argv(["prog", f"--config={path}", "--config_format=roll", "--config.trainer.seed=5"])
    assert (cfg.trainer.total_training_steps, cfg.trainer.seed, cfg.data.max_response_length) == (3, 5, 8)
    with pytest.raises(ValueError, match="unknown config key 'max_steps'"):  # read as verl's: not a key
        load_config_from_argv(["prog", f"--config={path}"])


TRINITY = os.path.join(os.path.dirname(__file__), "dialects", "trinity_grpo.yaml")


def test_trinity_file_maps_its_keys(monkeypatch):
    monkeypatch.delenv("TRINITY_CHECKPOINT_ROOT_DIR", raising=False)
    monkeypatch.setenv("MODEL_PATH", "/models/qwen")
    cfg = load_yaml(TRINITY)
    arr, t = cfg.actor_rollout_ref, cfg.trainer
    assert arr.model.path == "/models/qwen"  # ${oc.env:MODEL_PATH,...}
    assert (cfg.data.train_batch_size, arr.rollout.n, t.total_epochs) == (32, 8, 3)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.data.truncation) == (1024, 2048, "left")
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.algorithm.use_kl_in_reward
    assert (arr.actor.use_kl_loss, arr.actor.kl_loss_type, arr.actor.kl_loss_coef) == (True, "low_var_kl", 0.005)
    assert (arr.actor.clip_ratio_low, arr.actor.clip_ratio_high, arr.actor.entropy_coeff) == (0.2, 0.28, 0.001)
    assert arr.actor.optim.lr == 2e-6 and arr.actor.use_dynamic_bsz
    assert cfg.data.train_files == ("data/gsm8k/train.parquet",) and cfg.data.val_files == ("data/gsm8k/test.parquet",)
    assert (cfg.data.prompt_key, cfg.data.ground_truth_key, cfg.data.default_data_source) == ("question", "answer",
                                                                                              "math")
    assert (arr.rollout.val_kwargs.n, arr.rollout.val_kwargs.temperature) == (4, 0.6)
    assert (t.default_local_dir, t.save_freq, t.test_freq, t.val_before_train) == (
        "./checkpoints/Trinity-RFT/gsm8k-grpo", 50, 20, False)
    assert (t.nnodes, t.n_gpus_per_node) == (1, 8)  # cluster.node_num / gpu_per_node
    assert (t.project_name, t.experiment_name, t.max_actor_ckpt_to_keep) == ("Trinity-RFT", "gsm8k-grpo", 5)


def test_trinity_lora_and_advantage_arguments_map_onto_ours():
    base = "mode: both\nalgorithm:\n  algorithm_type: ppo\n  repeat_times: 2\nbuffer:\n  batch_size: 4\n"
    args = "  advantage_fn_args: {gamma: 0.9, lam: 0.8, epsilon: 1.0e-6}\n"
    cfg = load_yaml(base.replace("  repeat_times: 2\n", "  repeat_times: 2\n" + args)
                    + "model:\n  max_prompt_tokens: 8\n  lora_configs:\n  - {name: lora, lora_rank: 16, lora_alpha: 32, "
                      "target_modules: [q_proj, v_proj]}\n")
    assert (cfg.algorithm.gamma, cfg.algorithm.lam) == (0.9, 0.8)
    m = cfg.actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, tuple(m.target_modules)) == (16, 32.0, ("q_proj", "v_proj"))


def test_trinity_convert_round_trips_and_refuses_what_it_cannot_honour(tmp_path, caplog):
    converted = tmp_path / "converted.yaml"
    converted.write_text(convert(TRINITY))
    a = finalize(load_yaml(TRINITY), num_devices=8, check_paths=False, train_dataset_size=320)
    b = finalize(load_yaml(str(converted)), num_devices=8, check_paths=False, train_dataset_size=320)
    assert a.to_dict() == b.to_dict()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf_jax.config"):
        load_yaml(TRINITY)
    warnings = [r.getMessage() for r in caplog.records if "trinity keys have no meaning" in r.getMessage()]
    assert len(warnings) == 1 and "explorer.rollout_model" in warnings[0]
    base = "mode: both\nalgorithm:\n  algorithm_type: grpo\n  repeat_times: 2\nbuffer:\n  batch_size: 4\n"
    for text, key in [
        ("synchronizer:\n  sync_interval: 4\n  sync_offset: 2\n", r"sync_interval.*sync_offset=2: supported are"),
        ("synchronizer:\n  sync_style: trainer_driven\n", r"synchronizer\.sync_style='trainer_driven'"),
        ("stages:\n- stage_name: sft\n  algorithm:\n    algorithm_type: opmd\n", r"^stages\[0\] \(sft\): algorithm\.algorithm_type='opmd'"),
        ("explorer:\n  over_rollout:\n    ratio: 0.2\n", r"explorer\.over_rollout"),
        ("model:\n  max_prompt_tokens: 8\n  lora_configs: [{lora_rank: 8}, {lora_rank: 4}]\n",
         r"model\.lora_configs=.*one LoRA adapter per run"),
        ("algorithm:\n  advantage_fn_args: {std_threshold: 0.1}\n", r"advantage_fn_args\.std_threshold has no rlhf_jax"),
        ("unknown_section:\n  x: 1\n", r"unknown_section\.x \(trinity key\) has no rlhf_jax equivalent"),
    ]:
        with pytest.raises(ValueError, match=key):
            load_yaml(base + text)
    with pytest.raises(ValueError, match=r"mode='both': algorithm_type dpo trains from a dataset"):
        load_yaml(base.replace("grpo", "dpo"))
    with pytest.raises(ValueError, match=r"algorithm_type='opmd'"):
        load_yaml(base.replace("grpo", "opmd"))
    with pytest.raises(ValueError, match=r"buffer\.train_batch_size.*differs from buffer\.batch_size x"):
        load_yaml(base + "  train_batch_size: 6\n")


def test_trinity_synchronizer_is_the_experience_schedule():
    head = "mode: both\nalgorithm:\n  algorithm_type: grpo\n  repeat_times: 2\nbuffer:\n  batch_size: 4\n"
    on_policy = load_yaml(head).experience
    assert (on_policy.buffer_size, on_policy.overlap) == (1, False)
    every_4 = load_yaml(head + "synchronizer:\n  sync_interval: 4\n  sync_offset: 0\n").experience
    assert (every_4.buffer_size, every_4.overlap) == (4, False)  # 4 batches per set of weights, trained in order
    ahead = load_yaml(head + "synchronizer:\n  sync_offset: 1\n").experience  # sync_interval defaults to 1
    assert (ahead.buffer_size, ahead.overlap) == (1, True)  # sampling one step ahead of training


def test_trinity_workflow_type_and_args_name_one_of_our_workflows():
    head = "mode: both\nalgorithm:\n  algorithm_type: grpo\n  repeat_times: 2\nbuffer:\n  batch_size: 4\n"
    taskset = ("  explorer_input:\n    default_workflow_type: math_workflow\n    taskset:\n"
               "      default_workflow_type: my_agent\n      workflow_args:\n        calls: 3\n")
    mt = load_yaml(head + taskset).actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.workflow == "my_agent" and dict(mt.workflow_args) == {"calls": 3}
    single = load_yaml(head + "  explorer_input:\n    default_workflow_type: math_workflow\n")
    assert not single.actor_rollout_ref.rollout.multi_turn.enable
    with pytest.raises(ValueError, match=r"multi_turn\.workflow='my_agent' is not a registered workflow"):
        turn_settings(mt, response_length=16)  # what preparing the run looks up, before any model loads
    with pytest.raises(ValueError, match=r"default_eval_workflow_type.*validation runs the training workflow"):
        load_yaml(head + taskset + "    default_eval_workflow_type: math_workflow\n")


def test_trinity_file_trains_two_steps_with_overrides_in_our_keys(tmp_path):
    out = str(tmp_path / "run")
    overrides = {
        "actor_rollout_ref.model.path": "builtin:tiny",
        "data.train_files": "builtin:arithmetic?max_value=4&train_size=16",
        "data.val_files": "builtin:arithmetic?max_value=4&test_size=4",
        "data.train_split": "train", "data.val_split": "test", "data.prompt_key": "prompt",
        "data.ground_truth_key": "reward_model.ground_truth", "data.max_prompt_length": 48,
        "data.max_response_length": 4, "data.train_batch_size": 4, "data.val_batch_size": 4,
        "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "trainer.total_training_steps": 2, "trainer.default_local_dir": out,
        "trainer.n_gpus_per_node": 1,  # cluster.gpu_per_node: 8; this run has one device
    }
    args = [f"--config={TRINITY}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
    proc = run_main(args, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("trinity keys have no meaning in rlhf_jax") == 1
    assert os.path.isdir(os.path.join(out, "checkpoints", "2"))
    assert "step 2" in proc.stdout
