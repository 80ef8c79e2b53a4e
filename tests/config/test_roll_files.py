"""ROLL's own example files (tests/config/dialects/roll/, unedited; SOURCE.md) read, converted and trained."""

import json
import math
import os

import pytest
import yaml

from rlhf_jax.config.__main__ import convert
from rlhf_jax.config.yaml_import import load_yaml
from tests.config import trinity_runs as R
from tests.train.helpers import read_metrics

EXAMPLES = os.path.join(os.path.dirname(__file__), "dialects", "roll", "examples")
DPO = os.path.join(EXAMPLES, "dpo_examples", "qwen2.5-3B_dpo_megatron.yaml")
RLVR = os.path.join(EXAMPLES, "qwen2.5-7B-rlvr_megatron", "rlvr_config.yaml")
PPO = os.path.join(EXAMPLES, "docs_examples", "example_ppo.yaml")


def test_roll_dpo_file_maps_onto_the_dpo_trainer():
    cfg = load_yaml(DPO)
    arr, d = cfg.actor_rollout_ref, cfg.data
    assert cfg.algorithm.type == "dpo" and arr.model.path == "Qwen/Qwen2.5-3B-Instruct"
    assert (cfg.algorithm.dpo.beta, cfg.algorithm.dpo.label_smoothing, cfg.algorithm.dpo.loss_type) == (0.1, 0.0,
                                                                                                         "sigmoid")
    assert (d.prompt_key, d.chosen_key, d.rejected_key, d.prompt_template) == ("instruction", "chosen", "rejected",
                                                                              "native")
    # per_device_train_batch_size 16 x gradient_accumulation_steps 1 x 8 devices = 128 pairs, one optimizer step
    assert d.train_batch_size == arr.actor.ppo_mini_batch_size == 128
    assert (d.max_length, d.filter_overlong_prompts) == (512, True)  # sequence_length: longer pairs are dropped
    assert d.train_files == ("data/comparison_gpt4_data_zh.json",) and d.val_files == d.train_files
    t = cfg.trainer
    assert (t.total_training_steps, t.total_epochs, t.save_freq, t.test_freq) == (500, 10, 500, 100)
    assert t.default_local_dir == "/data/cpfs_0/rl_examples/models/qwen2.5-3B-dpo-config"  # checkpoint_config
    assert dict(t.env_vars) == {"USE_MODELSCOPE": "1"} and arr.model.compute_dtype == "bfloat16"
    assert load_yaml("pretrain: /m\nsequence_length: 64\nipo: true\n").algorithm.dpo.loss_type == "ipo"
    with pytest.raises(ValueError, match="DPO pipeline needs sequence_length"):
        load_yaml("pretrain: /m\nbeta: 0.2\n", fmt="roll")


def test_roll_rlvr_file_maps_its_reward_and_advantage_options_and_stops_at_the_llm_judge():
    """Every reward and advantage option of ROLL's RLVR example maps, and its domain weights; the file as written
    stops at the first feature rlhf_jax still lacks, an LLM judge as a reward worker."""
    with pytest.raises(ValueError, match=r"rlvr_config\.yaml: rewards\.llm_judge\.worker_cls=.*not supported"):
        load_yaml(RLVR)
    with open(RLVR) as fh:
        doc = yaml.safe_load(fh)
    del doc["rewards"]["llm_judge"]
    d = load_yaml(yaml.safe_dump(doc, sort_keys=False)).data
    assert dict(d.domain_weights) == {"math_rule": 0.4, "code_sandbox": 0.3, "llm_judge": 0.1, "crossthinkqa": 0.1,
                                      "ifeval": 0.1}
    assert (d.domain_key, d.tag_key, d.default_domain) == ("domain", "tag", "math_rule")
    assert {k: list(v) for k, v in d.domain_tags.items()} == {
        "crossthinkqa": ["crossthinkqa"], "ifeval": ["ifeval"], "math_rule": ["deepmath_103k", "aime"],
        "code_sandbox": ["KodCode"]}
    cfg = load_yaml(_without_missing_features(RLVR))
    alg, arr = cfg.algorithm, cfg.actor_rollout_ref
    # adv_estimator reinforce with norm_mean_type / norm_std_type null: the discounted return of the raw scores
    assert (alg.adv_estimator, alg.reward_norm.mean, alg.reward_norm.std, alg.gamma) == ("reinforce", None, None, 1.0)
    assert (alg.reward_clip, alg.advantage_clip, alg.whiten_advantages) == (10.0, 2.0, True)
    assert (alg.sample_mask.truncated, alg.sample_mask.difficulty) == (True, True)  # max_len_mask, difficulty_mask
    assert (alg.sample_mask.difficulty_low, alg.sample_mask.difficulty_high) == (0.1, 0.95)
    assert arr.actor.clip_ratio_c == pytest.approx(1.4)  # dual_clip_loss: ROLL's bound 1 + 2 pg_clip
    assert not alg.use_kl_in_reward and cfg.critic.model.path is None  # add_token_level_kl false; no critic
    assert dict(cfg.trainer.env_vars) == {"USE_MODELSCOPE": "1"}
    assert cfg.trainer.default_local_dir == "/data/cpfs_0/rl_examples/models/qwen2.5-7B-rlvr-config"


def _without_missing_features(path):
    """ROLL's file less the two parts rlhf_jax cannot run yet: the training data's domain mixing and the LLM judge
    reward worker (with its domain); everything else as written."""
    with open(path) as fh:
        doc = yaml.safe_load(fh)
    del doc["actor_train"]["data_args"]["domain_interleave_probs"]
    del doc["rewards"]["llm_judge"]
    return yaml.safe_dump(doc, sort_keys=False)


def _rl_overrides(out):
    return {
        "actor_rollout_ref.model.path": "builtin:tiny",
        "data.train_files": "builtin:arithmetic?max_value=4&train_size=16",
        "data.val_files": "builtin:arithmetic?max_value=4&test_size=4",
        "data.prompt_key": "prompt", "data.max_prompt_length": 48, "data.max_response_length": 6,
        "data.train_batch_size": 4, "data.val_batch_size": 4, "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4, "trainer.total_training_steps": 2,
        "trainer.default_local_dir": out, "trainer.log_dir": out, "trainer.n_gpus_per_node": 1,
        "trainer.logger": "('console','tensorboard','jsonl')",
    }


def _run(path, out, **extra):
    proc = R.run_file(path, {**_rl_overrides(out), **extra})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.isdir(os.path.join(out, "checkpoints", "2")) and "step 2" in proc.stdout
    return next(r for r in read_metrics(out) if any(k.startswith("actor/") for k in r))


def test_roll_rlvr_file_trains_two_steps_and_its_conversion_reads_the_same(tmp_path):
    source = tmp_path / "rlvr_config.yaml"
    source.write_text(_without_missing_features(RLVR))
    converted = tmp_path / "converted.yaml"
    converted.write_text(convert(str(source)))
    text = converted.read_text()
    assert "actor_train" not in text and "reward_clip: 10.0" in text and "adv_estimator: reinforce" in text
    # as written (shrunk): the tiny model's responses all reach the 6-token limit and score 0, so both masks
    # take every response out of the loss
    row = _run(str(source), str(tmp_path / "as_written"))
    assert row["actor/max_len_mask_ratio"] == 0.0 and row["actor/final_mask_ratio"] == 0.0
    assert row["actor/pg_loss"] == 0.0 and row["critic/advantages/max"] == 0.0
    # for numbers worth comparing: scores that differ within groups (a scorer by the response's characters) and
    # the length mask off; the difficulty mask, clips and whitening still act
    scorer = tmp_path / "parity.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(sum(map(ord, solution_str)) % 2)\n")
    extra = {"custom_reward_function.path": str(scorer), "algorithm.sample_mask.truncated": False}
    a = _run(str(source), str(tmp_path / "original"), **extra)
    assert a["actor/difficulty_mask_ratio"] > 0.0 and a["actor/grad_norm"] > 0.0  # whitened: pg_loss is 0 at ratio 1
    assert a["critic/advantages/max"] <= 2.0 and a["critic/advantages/min"] >= -2.0  # advantage_clip
    R.assert_same_settings(str(source), str(converted), {**_rl_overrides(str(tmp_path / "original")), **extra})


def _pairs(path, n, shift):
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"instruction": f"{i}+{shift}=", "chosen": str(i + shift),
                                 "rejected": str(i + shift + 1)}) + "\n")


def _overrides(tmp_path, out):
    return {
        "actor_rollout_ref.model.path": "builtin:tiny",
        "data.train_files": str(tmp_path / "train.jsonl"), "data.val_files": str(tmp_path / "val.jsonl"),
        "data.max_length": 48, "data.max_prompt_length": 32, "data.max_response_length": 16,
        "data.train_batch_size": 4, "data.val_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 2, "trainer.total_training_steps": 2,
        "trainer.default_local_dir": out, "trainer.log_dir": out, "trainer.n_gpus_per_node": 1,
        # metrics.jsonl as well as the file's tensorboard, to compare the two runs' numbers
        "trainer.logger": "('console','tensorboard','jsonl')",
    }


def test_roll_dpo_file_trains_two_steps_and_its_conversion_reads_the_same(tmp_path):
    _pairs(tmp_path / "train.jsonl", 16, 1)
    _pairs(tmp_path / "val.jsonl", 4, 2)
    converted = tmp_path / "converted.yaml"
    converted.write_text(convert(DPO))
    assert "actor_train" not in converted.read_text() and "env_vars" in converted.read_text()
    out = str(tmp_path / "original")
    proc = R.run_file(DPO, _overrides(tmp_path, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "environment of the run (trainer.env_vars): USE_MODELSCOPE=1" in proc.stderr
    assert os.path.isdir(os.path.join(out, "checkpoints", "2")) and "step 2" in proc.stdout
    # the first training step's row (a validation row before it has only val/ keys)
    first = next(r for r in read_metrics(out) if any(k.startswith(("dpo/", "actor/")) for k in r))
    assert any(k.startswith(("dpo/", "actor/")) and "loss" in k and math.isfinite(v) for k, v in first.items())
    R.assert_same_settings(DPO, str(converted), _overrides(tmp_path, out))


def test_roll_lora_settings_are_the_actors_adapters():
    base = "rollout_batch_size: 4\nresponse_length: 8\nadv_estimator: grpo\nnorm_mean_type: group\n"
    lora = ("actor_train:\n  model_args:\n    lora_target: all-linear\n    lora_rank: 64\n    lora_alpha: 32\n"
            "actor_infer:\n  model_args:\n    lora_target: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj\n"
            "    lora_rank: 64\n")
    m = load_yaml(base + lora).actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, tuple(m.target_modules)) == (64, 32.0, ("all-linear",))
    m = load_yaml(base + "actor_train:\n  model_args:\n    lora_target: q_proj, v_proj\n").actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, tuple(m.target_modules)) == (8, 16.0, ("q_proj", "v_proj"))  # ROLL's defaults
    assert load_yaml(base + "actor_train:\n  model_args:\n    lora_rank: 8\n").actor_rollout_ref.model.lora_rank == 0
    with pytest.raises(ValueError, match=r"lora_target='mlp': .*q_proj"):
        load_yaml(base + "actor_train:\n  model_args:\n    lora_target: mlp\n")
    with pytest.raises(ValueError, match=r"lora_dropout=0\.1 is not supported"):
        load_yaml(base + "actor_train:\n  model_args:\n    lora_target: all-linear\n    lora_dropout: 0.1\n")


def test_roll_freeze_module_prefix_freezes_whole_parameter_groups():
    base = "rollout_batch_size: 4\nresponse_length: 8\nadv_estimator: grpo\nnorm_mean_type: group\n"

    def frozen(prefixes):
        f = load_yaml(base + f"actor_train:\n  model_args:\n    freeze_module_prefix: {prefixes}\n"
                      ).actor_rollout_ref.actor.freeze
        return {g for g in ("emb", "ln", "attn", "ff", "other") if f[f"freeze_{g}"]}

    assert frozen("model.embed_tokens") == {"emb"}
    assert frozen("model.embed_tokens,lm_head") == {"emb", "other"}
    assert frozen("model.") == {"emb", "ln", "attn", "ff"}  # every parameter under model., not the output layer
    with pytest.raises(ValueError, match=r"freeze_module_prefix='model\.layers\.0': prefix 'model\.layers\.0' does "
                                         r"not name whole parameter groups"):
        frozen("model.layers.0")


def _math_rows(path, n):
    """Rows as ROLL's math data lays them out (messages, ground_truth, tag), with the domain column its pipeline
    fills in: the domain example_ppo.yaml names (math_rule) and one it does not (left out of the batches)."""
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i % 3}?"}],
                                 "ground_truth": str(i + i % 3), "tag": "deepmath_103k",
                                 "domain": "math_rule" if i % 4 else "code_sandbox"}) + "\n")


def _ppo_overrides(tmp_path, out):
    return {
        "actor_rollout_ref.model.path": "builtin:tiny", "critic.model.path": "builtin:tiny",
        "data.train_files": str(tmp_path / "math.jsonl"), "data.val_files": str(tmp_path / "math.jsonl"),
        "data.max_prompt_length": 48, "data.max_response_length": 6, "data.train_batch_size": 4,
        "data.val_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "critic.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2, "critic.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4, "critic.forward_micro_batch_size_per_gpu": 4,
        "trainer.total_training_steps": 2, "trainer.default_local_dir": out, "trainer.log_dir": out,
        "trainer.n_gpus_per_node": 1, "trainer.logger": "('console','jsonl')",
    }


def test_roll_ppo_docs_example_trains_two_steps_by_domain_and_its_conversion_reads_the_same(tmp_path):
    """ROLL's docs example as written (PPO with a critic of model_type trl, one domain math_rule sampled by
    domain_interleave_probs), shrunk by our keys only; its conversion to our keys reads to the same settings."""
    _math_rows(tmp_path / "math.jsonl", 16)
    cfg = load_yaml(PPO)
    assert dict(cfg.data.domain_weights) == {"math_rule": 1.0} and cfg.algorithm.adv_estimator == "gae"
    assert cfg.data.prompt_key == "messages" and cfg.critic.model.path == "Qwen/Qwen2.5-7B"
    converted = tmp_path / "converted.yaml"
    converted.write_text(convert(PPO))
    assert "actor_train" not in converted.read_text() and "domain_weights" in converted.read_text()
    out = str(tmp_path / "original")
    proc = R.run_file(PPO, _ppo_overrides(tmp_path, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.isdir(os.path.join(out, "checkpoints", "2")) and "step 2" in proc.stdout
    # the 4 code_sandbox rows are left out: the file's only domain is math_rule
    assert "training prompts by domain (data.domain_weights): each batch of 4: math_rule 4 (of 12 rows)" in (
        proc.stdout + proc.stderr)
    a = next(r for r in read_metrics(out) if any(k.startswith("actor/") for k in r))
    assert a["critic/vf_loss"] > 0.0 and a["actor/grad_norm"] > 0.0  # the critic trains (gae)
    R.assert_same_settings(PPO, str(converted), _ppo_overrides(tmp_path, out))
