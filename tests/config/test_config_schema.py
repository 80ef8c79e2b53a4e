"""The schema: every key documented and typed, the generated reference complete, the config locked."""

from __future__ import annotations

import pytest
from ml_collections import ConfigDict

from rlhf_jax.config import DERIVED_DOCS, DOCS, KEYS, base_config, describe, get_key, render_markdown, schema


def test_every_key_documented_and_no_stale_docs():
    cfg = base_config()
    leaves = [path for path, _ in schema.iter_leaves(cfg)]
    assert len(leaves) == len(KEYS) > 100
    assert set(leaves) == set(DOCS)
    for path in leaves:
        doc = DOCS[path]
        assert doc.strip() and "\n" not in doc and len(doc) < 200, path


def test_required_sections_and_verl_names_present():
    for path in (
        "data.train_files", "data.val_files", "data.prompt_key", "data.ground_truth_key", "data.train_split",
        "data.val_split", "data.max_prompt_length", "data.max_response_length", "data.truncation",
        "data.filter_overlong_prompts", "data.train_batch_size", "data.val_batch_size", "data.shuffle", "data.seed",
        "actor_rollout_ref.model.path", "actor_rollout_ref.model.dtype", "actor_rollout_ref.model.compute_dtype",
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "actor_rollout_ref.actor.policy_loss.loss_mode", "actor_rollout_ref.actor.optim.warmup_style",
        "actor_rollout_ref.actor.checkpoint.save_contents", "actor_rollout_ref.actor.clip_ratio_c",
        "actor_rollout_ref.rollout.val_kwargs.do_sample", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "critic.optim.lr", "critic.model.path", "critic.ppo_mini_batch_size", "critic.cliprange_value",
        "reward_model.enable", "reward_model.model.path", "reward_model.reward_manager", "reward_model.timeout_s",
        "reward_model.num_workers", "reward_model.fail_on_error", "reward_model.overlong_buffer.penalty_factor",
        "custom_reward_function.path", "custom_reward_function.name",
        "algorithm.adv_estimator", "algorithm.kl_ctrl.target_kl", "algorithm.norm_adv_by_std_in_grpo",
        "trainer.logger", "trainer.resume_mode", "trainer.save_hf_checkpoint", "trainer.max_actor_ckpt_to_keep",
        "trainer.log_val_generations", "trainer.seed", "mesh.data", "mesh.fsdp", "mesh.tensor",
        "mesh.logical_axis_rules",
    ):
        assert path in DOCS, path


def test_types_and_placeholders():
    cfg = base_config()
    for key in KEYS:
        value = schema.get_path(cfg, key.path)
        if key.default is None:
            assert value is None and key.type is not None, key.path
            # A placeholder keeps its type, so command-line overrides parse.
            *parents, leaf = key.path.split(".")
            node = cfg
            for p in parents:
                node = node[p]
            assert node.get_type(leaf) is key.type, key.path
        else:
            assert isinstance(value, key.value_type), key.path
    assert cfg.trainer.logger == ("console", "tensorboard", "jsonl")
    assert dict(cfg.mesh.logical_axis_rules)["batch"] == ("data", "fsdp", "expert")
    assert dict(cfg.mesh.logical_axis_rules)["vocab"] == "tensor"


def test_base_config_is_locked_and_fresh():
    cfg = base_config()
    with pytest.raises(AttributeError):
        cfg.actor_rollout_ref.actor.clip_ratoi = 0.3
    with pytest.raises(TypeError):
        cfg.data.train_batch_size = "many"
    cfg.data.train_batch_size = 7
    assert base_config().data.train_batch_size == 16  # no shared state


def test_check_known_keys_rejects_additions():
    cfg = base_config()
    cfg.unlock()
    cfg.trainer.total_epoch = 3
    with pytest.raises(ValueError, match=r"trainer\.total_epoch.*did you mean 'trainer\.total_epochs'"):
        schema.check_known_keys(cfg)


def test_get_key_suggests():
    with pytest.raises(KeyError, match="actor_rollout_ref.actor.kl_loss_coef"):
        get_key("actor_rollout_ref.actor.kl_loss_coeff")
    assert get_key("algorithm.kl_ctrl.type").choices == ("fixed", "adaptive")


def test_markdown_reference_lists_every_key():
    md = render_markdown()
    for path in DOCS:
        assert f"| `{path}` |" in md, path
    for path in DERIVED_DOCS:
        assert f"| `{path}` |" in md, path
    assert "`actor_rollout_ref.actor.fsdp_config.param_offload`" in md
    # Every table row has the same number of unescaped separators as its header.
    schema_part = md.split("## derived")[0]
    for line in schema_part.splitlines():
        if line.startswith("| `"):
            assert line.replace("\\|", "").count("|") == 6, line  # key, default, type, verl releases, description


def test_describe_line():
    line = describe("actor_rollout_ref.actor.clip_ratio")
    assert line.startswith("actor_rollout_ref.actor.clip_ratio = 0.2  # ")


def test_choices_defaults_valid():
    for key in KEYS:
        if key.choices and key.default is not None:
            values = key.default if isinstance(key.default, tuple) else (key.default,)
            assert all(v in key.choices for v in values), key.path


def test_iter_leaves_on_plain_dict():
    assert dict(schema.iter_leaves({"a": {"b": 1}, "c": 2})) == {"a.b": 1, "c": 2}
    assert isinstance(base_config().critic, ConfigDict)
