"""The memory plan's arithmetic bound: never below XLA's estimate of a pass, and a pass far from the free memory is
not compiled to learn that it fits."""

from __future__ import annotations

import pytest

from rlhf_jax.train import pass_bound
from rlhf_jax.train.pass_bound import needs_compile, role_pass_bound
from rlhf_jax.train.passes import HEADROOM, held_bytes, pass_bytes
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, tiny_hf_checkpoint

# Long rows and several of them, so that activations and attention scores dominate the parameters.
WIDE = {"data.max_prompt_length": 48, "data.max_response_length": 80, "data.train_batch_size": 8,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "critic.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2, "critic.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4}


MODELS = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
          "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2,
                                                                      moe_intermediate_size=32)),
          "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=6))}


@pytest.mark.parametrize("recipe, kind, packed", [("ppo", "qwen3", True), ("grpo", "qwen3_moe", True),
                                                  ("grpo", "gemma2", False)])
def test_the_bound_is_above_xlas_estimate_of_every_pass(recipe, kind, packed, tmp_path):
    config_cls, model_cls, extra = MODELS[kind]
    path = tiny_hf_checkpoint(config_cls, model_cls, str(tmp_path / kind), **extra)
    cfg = make_config(str(tmp_path), recipe, **WIDE, **{"actor_rollout_ref.model.path": path,
                                                         "actor_rollout_ref.model.use_remove_padding": packed})
    trainer = Trainer(cfg)
    checked = []
    for name, plan in trainer.plans.items():
        if not trainer.passes.runs(name):
            continue
        role = trainer._role_of(name)
        need = pass_bytes(trainer.compile_pass(name, plan), held_bytes(role, name))
        bound = role_pass_bound(plan, role, gradient=name.startswith("update"))
        assert 0 < need <= bound, (name, need, bound)
        checked.append(name)
    assert {"old_log_prob", "update_actor"} <= set(checked), checked
    trainer.close()


def test_a_pass_far_from_the_free_memory_is_not_compiled_and_one_near_it_is(tmp_path, monkeypatch):
    trainer = Trainer(make_config(str(tmp_path), "grpo"))
    compiled = []
    monkeypatch.setattr(trainer, "compile_pass", lambda name, plan: compiled.append(name) or (_ for _ in ()).throw(
        AssertionError(f"{name} was compiled")))
    trainer.plan_memory()
    assert compiled == []
    trainer.close()
    # With the free memory just above the bound of the update, the plan must compile it to know.
    trainer = Trainer(make_config(str(tmp_path / "near"), "grpo"))
    plan, role = trainer.plans["update_actor"], trainer.actor
    bound = role_pass_bound(plan, role, gradient=True)
    assert needs_compile(bound, int(bound / HEADROOM), HEADROOM)
    assert not needs_compile(bound, int(bound / (pass_bound.SKIP_FRACTION * HEADROOM)) + 1, HEADROOM)
    monkeypatch.setattr("rlhf_jax.train.trainer.free_device_memory", lambda: int(bound / HEADROOM))
    compile_pass = trainer.compile_pass
    monkeypatch.setattr(trainer, "compile_pass", lambda name, plan: compiled.append(name) or compile_pass(name, plan))
    trainer.plan_memory()
    assert "update_actor" in compiled
    trainer.close()
