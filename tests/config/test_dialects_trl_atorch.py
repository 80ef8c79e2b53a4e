"""The TRL-based Trainer_config.yaml and ATorch's config files: each converts, round-trips through `convert`, trains
two steps with only model, data and batch sizes overridden; keys with no meaning are warned about once, keys whose
value would change the run are refused by name (ROLL's and Trinity-RFT's: test_dialects.py)."""

import logging
import os

import pytest

from rlhf_jax.config import finalize
from rlhf_jax.config.__main__ import convert
from rlhf_jax.config.yaml_import import load_yaml
from tests.train.helpers import run_main



TRAINER_CONFIG = os.path.join(os.path.dirname(__file__), "dialects", "Trainer_config.yaml")


def test_trainer_config_file_maps_its_keys_and_trls_defaults(tmp_path):
    cfg = load_yaml(TRAINER_CONFIG)
    arr, d, alg = cfg.actor_rollout_ref, cfg.data, cfg.algorithm
    assert (d.train_files, d.val_files, d.train_split, d.val_split) == (("data/qa.json",), ("data/qa.json",), "train",
                                                                        "test")
    assert (d.prompt_key, d.ground_truth_key, d.max_prompt_length, d.max_response_length, d.truncation) == (
        "Question", "Answer", 256, 64, "left")
    assert arr.model.path == "gpt2" and (d.train_batch_size, arr.rollout.n) == (16, 1)
    assert arr.actor.ppo_mini_batch_size == 8 and arr.actor.ppo_epochs == 2  # mini_batch_size 4 x accumulation 2
    assert (arr.rollout.top_k, arr.rollout.top_p, arr.rollout.do_sample) == (-1, 1.0, True)
    assert (arr.actor.optim.lr, arr.actor.grad_clip) == (1e-5, 1.0)
    # TRL's value head sits on the policy's trunk, its loss weighed by vf_coef (TRL's default 0.1)
    assert cfg.critic.shared_trunk and cfg.critic.vf_coef == 0.1
    with open(TRAINER_CONFIG) as f:
        text = f.read()
    assert "vf_coef" not in text
    (tmp_path / "vf.yaml").write_text(text.replace("ppo_config:\n", "ppo_config:\n  vf_coef: 0.5\n", 1))
    assert load_yaml(str(tmp_path / "vf.yaml")).critic.vf_coef == 0.5
    assert cfg.reward_model.enable and cfg.reward_model.model.path == "OpenAssistant/reward-model-deberta-v3-base"
    assert cfg.reward_model.micro_batch_size_per_gpu == 4
    # TRL's PPO: GAE, adaptive in-reward KL from 0.2 towards 6, lam 0.95, no dual clip
    assert (alg.adv_estimator, alg.use_kl_in_reward, alg.kl_ctrl.type, alg.kl_ctrl.kl_coef, alg.kl_ctrl.target_kl) == (
        "gae", True, "adaptive", 0.2, 6.0)
    assert (alg.lam, cfg.critic.cliprange_value, arr.actor.clip_ratio_c) == (0.95, 0.2, 1e30)
    t = cfg.trainer
    assert (t.total_epochs, t.total_training_steps, t.seed, t.save_freq, t.project_name) == (2, 100, 11, 50, "rlhf-qa")
    assert t.logger == ("console", "wandb") and t.default_local_dir == "./checkpoints"
    for text, key in [
        ("freeze_config:\n  layers_not_to_freeze: [h.3]\n", r"layers_not_to_freeze=\['h\.3'\]: 'h\.3' is not a"),
        ("ppo_config:\n  early_stopping: true\n", r"ppo_config\.early_stopping"),
        ("ppo_config:\n  batch_size: 10\n  mini_batch_size: 4\n", r"batch_size=10 is not a multiple"),
    ]:
        with pytest.raises(ValueError, match=key):
            load_yaml("reward_config:\n  reward_model_name: rm\n" + text)
    with pytest.raises(ValueError, match="reward_model_name is required"):
        load_yaml("ppo_config:\n  batch_size: 4\n  mini_batch_size: 4\n")
    converted = tmp_path / "converted.yaml"
    converted.write_text(convert(TRAINER_CONFIG))
    a = finalize(load_yaml(TRAINER_CONFIG), num_devices=2, check_paths=False, train_dataset_size=64)
    b = finalize(load_yaml(str(converted)), num_devices=2, check_paths=False, train_dataset_size=64)
    assert a.to_dict() == b.to_dict()


def test_trainer_config_file_trains_two_steps_with_overrides_in_our_keys(tmp_path):
    import json

    from tests.train.helpers import tiny_hf_checkpoint

    qa = tmp_path / "qa.json"
    qa.write_text(json.dumps({"train": [{"Question": f"{i}+1=", "Answer": str(i + 1)} for i in range(16)],
                              "test": [{"Question": f"{i}+2=", "Answer": str(i + 2)} for i in range(4)]}))
    rm = tiny_hf_checkpoint("LlamaConfig", "LlamaForSequenceClassification", str(tmp_path / "rm"), num_labels=1)
    out = str(tmp_path / "run")
    overrides = {
        "actor_rollout_ref.model.path": "builtin:tiny", "reward_model.model.path": rm,
        "data.train_files": str(qa), "data.val_files": str(qa), "data.max_prompt_length": 48,
        "data.max_response_length": 4, "data.train_batch_size": 4, "data.val_batch_size": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "reward_model.micro_batch_size_per_gpu": 2,
        "trainer.total_training_steps": 2, "trainer.default_local_dir": out,
    }
    args = [f"--config={TRAINER_CONFIG}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
    proc = run_main(args, devices=1, env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("trainer_config keys have no meaning in rlhf_jax") == 1
    assert os.path.isdir(os.path.join(out, "checkpoints", "2")) and "step 2" in proc.stdout


ATORCH = os.path.join(os.path.dirname(__file__), "dialects", "atorch_ppo.yaml")


def test_atorch_file_maps_its_keys():
    cfg = load_yaml(ATORCH)
    arr, d, t = cfg.actor_rollout_ref, cfg.data, cfg.trainer
    assert arr.model.path == cfg.critic.model.path == d.tokenizer == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.reward_model.enable and cfg.reward_model.model.path == "OpenAssistant/reward-model-deberta-v3-base"
    assert cfg.algorithm.use_kl_in_reward  # ref_model listed: trlx's KL penalty in the reward
    assert d.truncation == "left" and t.total_epochs == 3
    # experience_buffer_size experiences per step, eg_batch_size decoded at once, rl_batch_size per update
    assert (d.train_batch_size, arr.rollout.max_num_seqs, arr.rollout.n) == (32, 8, 1)
    assert (arr.actor.ppo_mini_batch_size, arr.actor.ppo_epochs) == (16, 2)
    assert cfg.algorithm.adv_estimator == "gae" and arr.actor.clip_ratio_c == 1e30
    o = arr.actor.optim
    assert (o.optimizer, o.lr, tuple(o.betas), o.weight_decay, o.eps) == ("AdamW", 2e-6, (0.9, 0.95), 0.05, 1e-8)
    assert dict(o.override_optimizer_config) == {"fused": True}
    c = cfg.critic.optim
    assert (c.optimizer, c.lr, c.weight_decay) == ("Adafactor", 1e-5, 0.0)  # transformers' weight_decay default
    assert dict(c.override_optimizer_config) == {"relative_step": False, "scale_parameter": False,
                                                     "clip_threshold": 0.5, "beta1": 0.9}
    # no optimizer given: ATorch's default, torch.optim.Adam with torch's own defaults
    assert not cfg.experience.overlap  # mode: sequential
    # concurrent: the next experiences are generated on devices of their own while training; the file does not
    # say how many, so finalize asks for mesh.rollout_devices
    concurrent = load_yaml("train:\n  mode: concurrent\n  eg_batch_size: 8\n  rl_batch_size: 4\n")
    assert concurrent.experience.overlap
    with pytest.raises(ValueError, match=r"experience\.overlap=True .*set mesh\.rollout_devices"):
        finalize(concurrent, num_devices=8, check_paths=False, train_dataset_size=64)
    concurrent.mesh.rollout_devices = 4
    assert finalize(concurrent, num_devices=8, check_paths=False, train_dataset_size=64).experience.overlap
    plain = load_yaml("model:\n  actor:\n    model_path: /m\ntrain:\n  eg_batch_size: 4\n")
    o = plain.actor_rollout_ref.actor.optim
    assert (o.optimizer, o.lr, o.weight_decay, tuple(o.betas)) == ("Adam", 1e-3, 0.0, (0.9, 0.999))
    assert plain.data.train_batch_size == 4  # no experience_buffer_size: one generation batch per step
    # actor_critic: one model for both roles = a value head on the actor's trunk, trained by its optimizer
    shared = load_yaml("model:\n  actor_critic:\n    model_path: /m\n    optimizer:\n      name: SGD\n"
                       "      kwargs:\n        lr: 0.01\n")
    assert shared.actor_rollout_ref.model.path == "/m" and shared.critic.shared_trunk and shared.critic.enable
    assert (shared.actor_rollout_ref.actor.optim.optimizer, shared.actor_rollout_ref.actor.optim.lr) == ("SGD", 0.01)
    assert finalize(shared, num_devices=8, check_paths=False, train_dataset_size=64).critic.model.path == "/m"


def test_atorch_convert_round_trips_warns_once_and_refuses_what_it_cannot_honour(tmp_path, caplog):
    converted = tmp_path / "converted.yaml"
    converted.write_text(convert(ATORCH))
    a = finalize(load_yaml(ATORCH), num_devices=8, check_paths=False, train_dataset_size=320)
    b = finalize(load_yaml(str(converted)), num_devices=8, check_paths=False, train_dataset_size=320)
    assert a.to_dict() == b.to_dict()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf_jax.config"):
        load_yaml(ATORCH)
    warnings = [r.getMessage() for r in caplog.records if "atorch keys have no meaning" in r.getMessage()]
    assert len(warnings) == 1 and "tokenizer.params.padding_side" in warnings[0]
    assert "model.actor.train_strategy" in warnings[0]
    base = "model:\n  actor:\n    model_path: /m\n"
    for text, key in [
        ("  actor_critic:\n    model_path: /m\n", r"model\.actor_critic=.*: list either model\.actor_critic or"),
        ("  actor_critic_ref:\n    model_path: /m\n", r"model\.actor_critic_ref: one model sharing its weights "
                                                     r"between actor, critic and ref_model is not implemented"),
        ("  reward_critic:\n    model_path: /m\n", r"model\.reward_critic: .*reward_model and critic"),
        ("train:\n  mode: parallel\n", r"train\.mode='parallel': use sequential or concurrent"),
        ("train:\n  strategy_file: s.py\n", r"train\.strategy_file='s\.py' is not supported"),
        ("train:\n  trainer: DPOTrainer\n", r"train\.trainer='DPOTrainer'"),
        ("train:\n  experience_buffer_size: 12\n  rl_batch_size: 8\n", r"rl_batch_size=8 does not divide"),
        ("  critic:\n    model_path: m.py\n    model_cls: Critic\n", r"model\.critic\.model_path='m\.py'"),
        ("  critic:\n    model_path: /m\n    model_cls: Critic\n", r"model\.critic\.model_cls='Critic'"),
        ("  ref_model:\n    model_path: /other\n", r"model\.ref_model\.model_path='/other' differs"),
        ("  reward_model:\n    model_path: /rm\n    optimizer:\n      name: adam\n",
         r"model\.reward_model\.optimizer\.name='adam' is not supported.*not trained"),
        ("    train_strategy: fsdp_strategy\n", r"model\.actor\.train_strategy='fsdp_strategy'"),
        ("    model_params:\n      torch_dtype: auto\n", r"model\.actor\.model_params\.torch_dtype='auto': use"),
        ("    model_params:\n      trust_remote_code: true\n", r"model_params\.trust_remote_code=True is not supp"),
        ("    optimizer:\n      name: torch.optim.RMSprop\n", r"model\.actor\.optimizer\.name='torch\.optim\.RMSprop'"),
        ("    optimizer:\n      name: AdamW\n      kwargs:\n        amsgrad: true\n",
         r"model\.actor\.optimizer\.kwargs\.amsgrad=True is not supported for AdamW"),
        ("    optimizer:\n      name: Adafactor\n", r"model\.actor\.optimizer\.kwargs: Adafactor without lr"),
        ("tokenizer:\n  params:\n    truncation_side: middle\n", r"truncation_side='middle'"),
        ("tokenizer:\n  params:\n    use_fast: false\n", r"tokenizer\.params\.use_fast=False is not supported"),
        ("train:\n  rl_steps: 3\n", r"train\.rl_steps \(atorch key\) has no rlhf_jax equivalent"),
    ]:
        with pytest.raises(ValueError, match=key):
            load_yaml(base + text)


def test_atorch_file_trains_two_steps_with_overrides_in_our_keys(tmp_path):
    from tests.train.helpers import tiny_hf_checkpoint

    rm = tiny_hf_checkpoint("LlamaConfig", "LlamaForSequenceClassification", str(tmp_path / "rm"), num_labels=1)
    out = str(tmp_path / "run")
    overrides = {
        "actor_rollout_ref.model.path": "builtin:tiny", "critic.model.path": "builtin:tiny",
        "data.tokenizer": "builtin:tiny", "reward_model.model.path": rm,
        "data.train_files": "builtin:arithmetic?max_value=4&train_size=16",
        "data.val_files": "builtin:arithmetic?max_value=4&test_size=4", "data.prompt_key": "prompt",
        "data.max_prompt_length": 48, "data.max_response_length": 4, "data.train_batch_size": 4,
        "data.val_batch_size": 4, "actor_rollout_ref.rollout.max_num_seqs": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "reward_model.micro_batch_size_per_gpu": 2,
        "trainer.total_training_steps": 2, "trainer.default_local_dir": out,
    }
    args = [f"--config={ATORCH}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
    proc = run_main(args, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("atorch keys have no meaning in rlhf_jax") == 1
    assert os.path.isdir(os.path.join(out, "checkpoints", "2")) and "step 2" in proc.stdout
