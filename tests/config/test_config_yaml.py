"""verl-style YAML import: interpolation, warned keys, unknown keys, coercion."""

from __future__ import annotations

import logging

import pytest

from rlhf_jax.config import apply_mapping, load_yaml
from rlhf_jax.config.interpolation import InterpolationError

# A run file in the shape of verl's ppo_trainer.yaml (sections and key names as documented there).
VERL_YAML = """
data:
  tokenizer: null
  train_files: ~/data/gsm8k/train.parquet
  val_files: [~/data/gsm8k/test.parquet, ~/data/math/test.parquet]
  prompt_key: prompt
  max_prompt_length: 512
  max_response_length: 1024
  train_batch_size: 1024
  return_raw_input_ids: False
  return_raw_chat: False
  shuffle: True
  filter_overlong_prompts: True
  truncation: error
actor_rollout_ref:
  hybrid_engine: True
  model:
    path: ~/models/Qwen2.5-7B-Instruct
    external_lib: null
    enable_gradient_checkpointing: True
    use_remove_padding: True
  actor:
    strategy: fsdp
    ppo_mini_batch_size: 256
    ppo_micro_batch_size: null
    ppo_micro_batch_size_per_gpu: 8
    use_dynamic_bsz: False
    ppo_max_token_len_per_gpu: 16384
    grad_clip: 1.0
    clip_ratio: 0.2
    use_kl_loss: True
    use_torch_compile: True
    kl_loss_coef: 0.001
    kl_loss_type: low_var_kl
    optim:
      lr: 1e-6
      lr_warmup_steps: -1
      lr_warmup_steps_ratio: 0.
      warmup_style: cosine
      total_training_steps: -1
    fsdp_config:
      param_offload: False
      wrap_policy:
        min_num_params: 0
    checkpoint:
      save_contents: ['model', 'optimizer', 'extra']
      load_contents: ${actor_rollout_ref.actor.checkpoint.save_contents}
  ref:
    log_prob_micro_batch_size_per_gpu: 16
    log_prob_use_dynamic_bsz: ${actor_rollout_ref.actor.use_dynamic_bsz}
    ulysses_sequence_parallel_size: ${actor_rollout_ref.actor.ulysses_sequence_parallel_size}
  rollout:
    name: vllm
    temperature: 1.0
    top_k: -1
    top_p: 1
    response_length: ${data.max_response_length}
    gpu_memory_utilization: 0.5
    enforce_eager: True
    n: 5
    engine_kwargs:
      vllm:
        swap_space: null
    val_kwargs:
      top_k: -1
      top_p: 1.0
      temperature: 0
      n: 1
      do_sample: False
algorithm:
  gamma: 1.0
  lam: 1.0
  adv_estimator: grpo
  use_kl_in_reward: False
  kl_ctrl:
    type: fixed
    kl_coef: 0.001
trainer:
  total_epochs: 30
  project_name: verl_examples
  experiment_name: gsm8k
  logger: ['console', 'tensorboard']
  nnodes: 1
  n_gpus_per_node: 8
  save_freq: -1
  test_freq: 2
  default_hdfs_dir: ~/experiments/gsm8k/ppo/${trainer.experiment_name}
  default_local_dir: checkpoints/${trainer.project_name}/${trainer.experiment_name}
  resume_mode: auto
"""

WARNED = {
    "data.return_raw_input_ids", "data.return_raw_chat", "actor_rollout_ref.hybrid_engine",
    "actor_rollout_ref.model.external_lib",
    "actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.ppo_micro_batch_size",
    "actor_rollout_ref.actor.use_torch_compile", "actor_rollout_ref.actor.optim.total_training_steps",
    "actor_rollout_ref.actor.fsdp_config.wrap_policy",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size", "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.enforce_eager",
    "actor_rollout_ref.rollout.engine_kwargs", "trainer.default_hdfs_dir",
}


def _warned_keys(caplog) -> list[str]:
    """The keys listed in the importer's one warning about ignored verl keys (lines '  a, b: reason')."""
    records = [r for r in caplog.records if r.levelno == logging.WARNING and "are ignored:" in r.getMessage()]
    assert len(records) <= 1  # listed once
    keys = []
    for rec in records:
        for line in rec.getMessage().splitlines()[1:]:
            keys.extend(line.strip().split(": ", 1)[0].split(", "))
    return keys


def test_verl_yaml_loads(tmp_path, caplog):
    path = tmp_path / "run.yaml"
    path.write_text(VERL_YAML)
    with caplog.at_level(logging.WARNING, logger="rlhf_jax.config"):
        cfg = load_yaml(str(path))
    # One warning listing every non-JAX key (a whole ignored subtree counts once), naming the file.
    warned = _warned_keys(caplog)
    assert sorted(warned) == sorted(WARNED)
    assert all(str(path) in r.getMessage() for r in caplog.records if "are ignored:" in r.getMessage())
    # Values landed on the schema, with types coerced.
    assert cfg.data.train_files == ("~/data/gsm8k/train.parquet",)
    assert cfg.data.val_files == ("~/data/gsm8k/test.parquet", "~/data/math/test.parquet")
    assert cfg.data.max_response_length == 1024
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)  # YAML reads "1e-6" as a string
    assert isinstance(cfg.actor_rollout_ref.rollout.top_p, float) and cfg.actor_rollout_ref.rollout.top_p == 1.0
    assert cfg.actor_rollout_ref.rollout.val_kwargs.temperature == 0.0
    assert cfg.actor_rollout_ref.actor.optim.warmup_style == "cosine"
    assert cfg.trainer.logger == ("console", "tensorboard")
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 8)  # the devices the run uses
    # ${...} references: typed when whole, substituted inside strings.
    assert cfg.actor_rollout_ref.rollout.response_length == 1024
    assert cfg.actor_rollout_ref.actor.checkpoint.load_contents == ("model", "optimizer", "extra")
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    # Packing keys are honoured, references resolved.
    assert cfg.actor_rollout_ref.model.use_remove_padding is True
    assert cfg.actor_rollout_ref.actor.use_dynamic_bsz is False
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 16384
    assert cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz is False
    # data.tokenizer: null on a nullable key stays None; the config is still locked.
    assert cfg.data.tokenizer is None
    with pytest.raises(AttributeError):
        cfg.data.bogus = 1


def test_unknown_key_names_key_and_suggests():
    with pytest.raises(ValueError, match=r"unknown config key 'actor_rollout_ref\.actor\.clip_ratio_hgih'.*"
                                         r"did you mean 'actor_rollout_ref\.actor\.clip_ratio_high'"):
        load_yaml("actor_rollout_ref:\n  actor:\n    clip_ratio_hgih: 0.28\n")
    with pytest.raises(ValueError, match=r"unknown config key 'trainer\.total_epoch'.*'trainer\.total_epochs'"):
        load_yaml("trainer:\n  total_epoch: 3\n")
    with pytest.raises(ValueError, match=r"unknown config key 'foo'"):
        load_yaml("foo: 1\nbar: 2\n")


def test_unsupported_feature_switched_on_is_an_error(caplog):
    # Off: accepted with a warning.
    with caplog.at_level(logging.WARNING, logger="rlhf_jax.config"):
        load_yaml("algorithm:\n  use_pf_ppo: False\n")
    assert _warned_keys(caplog) == ["algorithm.use_pf_ppo"]
    # On: refused, naming the key.
    with pytest.raises(ValueError, match=r"algorithm\.use_pf_ppo=True is not supported.*prioritized-replay"):
        load_yaml("algorithm:\n  use_pf_ppo: True\n")
    with pytest.raises(ValueError, match=r"reward_model\.ulysses_sequence_parallel_size=2 is not supported"):
        load_yaml("reward_model:\n  ulysses_sequence_parallel_size: 2\n")


def test_ulysses_size_maps_onto_the_context_axis():
    """verl's Ulysses size is mesh.context; the reference's and the critic's are read as the actor's."""
    cfg = load_yaml("actor_rollout_ref:\n  actor:\n    ulysses_sequence_parallel_size: 4\n  ref:\n"
                    "    ulysses_sequence_parallel_size: 4\ncritic:\n  ulysses_sequence_parallel_size: 1\n")
    assert cfg.mesh.context == 4
    assert load_yaml("actor_rollout_ref:\n  actor:\n    fsdp_config:\n      ulysses_sequence_parallel_size: 2\n"
                     ).mesh.context == 2
    with pytest.raises(ValueError, match=r"critic\.ulysses_sequence_parallel_size=0 is not supported"):
        load_yaml("critic:\n  ulysses_sequence_parallel_size: 0\n")


def test_exact_ignore_entry_wins_over_wildcard(caplog):
    with caplog.at_level(logging.WARNING, logger="rlhf_jax.config"):
        load_yaml("data:\n  trust_remote_code: True\n")
    assert "tokenizers are loaded without remote code" in caplog.records[0].getMessage()


def test_null_keeps_concrete_default(caplog):
    with caplog.at_level(logging.INFO, logger="rlhf_jax.config"):
        cfg = load_yaml("actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: null\n")
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 1
    assert any("ppo_micro_batch_size_per_gpu is null" in r.getMessage() for r in caplog.records)


def test_type_errors_name_the_key():
    with pytest.raises(ValueError, match=r"data\.train_batch_size: expected int, got 'lots'"):
        load_yaml("data:\n  train_batch_size: lots\n")
    with pytest.raises(ValueError, match=r"data\.shuffle: expected bool"):
        load_yaml("data:\n  shuffle: 3\n")
    with pytest.raises(ValueError, match=r"data\.train_batch_size: expected int, got 2\.5"):
        load_yaml("data:\n  train_batch_size: 2.5\n")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor is a section"):
        load_yaml("actor_rollout_ref:\n  actor: 3\n")


def test_interpolation_env_chain_and_errors(monkeypatch):
    monkeypatch.setenv("RLHF_TEST_PROJECT", "from_env")
    cfg = load_yaml(
        "trainer:\n  project_name: ${oc.env:RLHF_TEST_PROJECT}\n  experiment_name: ${oc.env:RLHF_UNSET_X,exp1}\n"
        "data:\n  max_prompt_length: 64\n  max_response_length: ${data.max_prompt_length}\n"
        "actor_rollout_ref:\n  rollout:\n    response_length: ${data.max_response_length}\n"
    )
    assert (cfg.trainer.project_name, cfg.trainer.experiment_name) == ("from_env", "exp1")
    assert cfg.actor_rollout_ref.rollout.response_length == 64  # chained references
    # A reference to a key the YAML does not set falls back to the base config.
    cfg = load_yaml("actor_rollout_ref:\n  rollout:\n    response_length: ${data.max_response_length}\n")
    assert cfg.actor_rollout_ref.rollout.response_length == 16
    with pytest.raises(InterpolationError, match="circular"):
        load_yaml("trainer:\n  project_name: ${trainer.experiment_name}\n  experiment_name: ${trainer.project_name}\n")
    with pytest.raises(InterpolationError, match=r"trainer\.project_name: \$\{data\.nope\} refers to a key"):
        load_yaml("trainer:\n  project_name: ${data.nope}\n")
    with pytest.raises(InterpolationError, match="RLHF_UNSET_Y"):
        load_yaml("trainer:\n  project_name: ${oc.env:RLHF_UNSET_Y}\n")


def test_apply_mapping_onto_a_recipe():
    base = apply_mapping({"algorithm": {"adv_estimator": "rloo"}})
    cfg = apply_mapping({"actor_rollout_ref": {"rollout": {"n": 4}}}, base, source="override")
    assert cfg.algorithm.adv_estimator == "rloo" and cfg.actor_rollout_ref.rollout.n == 4
    assert base.actor_rollout_ref.rollout.n == 1  # the base is not modified


def test_mapping_valued_key_and_finalize():
    from rlhf_jax.config import finalize

    cfg = load_yaml("reward_model:\n  scorer_kwargs:\n    arithmetic:\n      format_score: 0.0\n")
    assert dict(cfg.reward_model.scorer_kwargs["arithmetic"]) == {"format_score": 0.0}
    cfg.algorithm.adv_estimator = "grpo"
    cfg.actor_rollout_ref.rollout.n = 2
    out = finalize(cfg, num_devices=1)
    assert out.reward_model.scorer_kwargs["arithmetic"]["format_score"] == 0.0


def test_missing_file_and_empty_yaml(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_yaml(str(tmp_path / "nope.yaml"))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_yaml(str(empty)).data.train_batch_size == 16
