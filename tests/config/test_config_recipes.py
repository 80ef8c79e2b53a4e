"""The recipes in configs/: each loads, finalizes on 1-8 devices, and sets its algorithm's values."""

from __future__ import annotations

import os
import shutil

import pytest

from rlhf_jax.config import finalize, load_config_from_argv
from rlhf_jax.models.hub import resolve_model_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = ("grpo", "ppo", "rloo", "reinforce_pp", "dapo")


def load(name: str, *overrides: str):
    return load_config_from_argv(["prog", f"--config={os.path.join(REPO, 'configs', name + '.py')}", *overrides])


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_recipe_finalizes(name, devices):
    out = finalize(load(name), num_devices=devices)
    d = out.derived
    assert d.dp_size == devices
    micro = out.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    if micro == -1:  # the whole per-shard mini-batch in one pass
        assert d.actor_grad_accum_steps == 1 and d.actor_mini_batch_size_per_shard * devices == d.actor_mini_batch_size
    else:
        assert d.actor_grad_accum_steps * micro * devices == d.actor_mini_batch_size
    # Built-in model and data: nothing to download.
    assert out.actor_rollout_ref.model.path == "builtin:tiny"
    assert all(f.startswith("builtin:") for f in out.data.train_files + out.data.val_files)
    assert d.max_seq_len <= d.model_max_position_embeddings
    assert out.trainer.experiment_name.startswith(name)


def test_grpo_values():
    out = finalize(load("grpo"), num_devices=1)
    assert out.algorithm.adv_estimator == "grpo" and out.critic.enable is False
    assert out.actor_rollout_ref.rollout.n == 16 and out.data.train_batch_size == 16
    assert out.actor_rollout_ref.actor.use_kl_loss and out.derived.need_ref
    assert out.actor_rollout_ref.rollout.response_length == 1  # one-token answers (see configs/grpo.py)
    assert out.derived.actor_grad_accum_steps == 1 and out.derived.log_prob_micro_batches == 1


def test_ppo_values():
    out = finalize(load("ppo"), num_devices=2)
    assert out.algorithm.adv_estimator == "gae" and out.critic.enable is True
    assert out.critic.model.path == "builtin:tiny"
    assert out.derived.critic_updates_per_step == 2 and out.actor_rollout_ref.rollout.n == 1


def test_rloo_and_reinforce_pp_values():
    rloo = finalize(load("rloo"), num_devices=1)
    assert rloo.algorithm.adv_estimator == "rloo" and rloo.algorithm.use_kl_in_reward
    rpp = finalize(load("reinforce_pp"), num_devices=1)
    assert rpp.algorithm.adv_estimator == "reinforce_plus_plus" and rpp.critic.enable is False
    assert rpp.derived.need_ref


def test_dapo_values():
    out = finalize(load("dapo"), num_devices=1)
    actor = out.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
    assert actor.loss_agg_mode == "token-mean" and not actor.use_kl_loss
    assert not out.algorithm.use_kl_in_reward and not out.derived.need_ref
    ob = out.reward_model.overlong_buffer
    assert ob.enable and 0 < ob.len < out.actor_rollout_ref.rollout.response_length


def test_recipe_switches_estimator_by_override():
    out = finalize(load("grpo", "--config.algorithm.adv_estimator=rloo"), num_devices=1)
    assert out.algorithm.adv_estimator == "rloo"
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator=gae needs a value model"):
        finalize(load("grpo", "--config.algorithm.adv_estimator=gae", "--config.critic.enable=false"), num_devices=1)


def test_smollm2_recipe_finalizes_with_a_tiny_model_standing_in(hf_checkpoint):
    """configs/grpo_smollm2.py validates as written for a local model directory, and on 8 devices by changing
    only the mesh and dtype keys (what a GPU/TPU run changes)."""
    path, _ = hf_checkpoint("llama", max_position_embeddings=512)  # a tiny Llama in place of the converted SmolLM2
    for name in ("tokenizer.json", "tokenizer_config.json"):  # and the tiny model's tokenizer, as a run reads one
        shutil.copy(os.path.join(resolve_model_path("builtin:tiny"), name), path)
    cpu = finalize(load("grpo_smollm2", f"--config.actor_rollout_ref.model.path={path}"), num_devices=1)
    assert cpu.algorithm.adv_estimator == "grpo" and not cpu.derived.need_ref
    assert cpu.data.train_batch_size == 8 and cpu.actor_rollout_ref.rollout.n == 8
    assert 128 <= cpu.actor_rollout_ref.rollout.response_length <= 256
    assert cpu.data.prompt_template == "native" and cpu.data.val_files[0].endswith("test_size=200")
    assert not cpu.derived.recompute_old_log_prob  # one mini-batch, one epoch: the sampler's log-probs
    accel = finalize(load("grpo_smollm2", f"--config.actor_rollout_ref.model.path={path}", "--config.mesh.data=-1",
                          "--config.actor_rollout_ref.model.compute_dtype=bfloat16"), num_devices=8)
    assert accel.derived.dp_size == 8


def test_smollm2_recipe_names_the_builtin_model():
    cfg = load("grpo_smollm2")
    assert cfg.actor_rollout_ref.model.path == "builtin:smollm2"
