"""LoRA in a GRPO run: only the adapters train, the reference is the base with adapters off (one copy of the base
weights), exports (merged model, PEFT adapter) and continuing from an adapter."""

import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
import transformers
from flax import nnx

from rlhf_jax.models import lora
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, run_tool

LORA = {"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.lora_alpha": 8.0,
        "actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.optim.lr": 2e-2}


def _host(state) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def _embed_copies() -> int:
    """Live device arrays shaped like the tiny model's embedding table (264 x 64)."""
    gc.collect()
    return sum(1 for x in jax.live_arrays() if x.shape == (264, 64))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lora"))
    before_copies = _embed_copies()
    trainer = Trainer(make_config(out, "grpo", **LORA, **{"trainer.total_training_steps": 3, "trainer.save_freq": 1,
                                                           "trainer.save_hf_checkpoint": "last"}))
    copies = {"built": _embed_copies() - before_copies}
    before = _host(trainer.actor.state())
    trainer.fit()
    copies["trained"] = _embed_copies() - before_copies
    return trainer, out, before, copies


def test_only_adapter_weights_change(run):
    trainer, _, before, _ = run
    after = _host(trainer.actor.state())
    adapters = [p for p in before if lora.is_adapter(p)]
    base = [p for p in before if not lora.is_adapter(p)]
    assert len(adapters) == 2 * 7 * trainer.actor.config.num_hidden_layers  # all-linear: 7 projections per layer
    for p in base:
        np.testing.assert_array_equal(after[p], before[p], err_msg=str(p))
    b_changed = [p for p in adapters if str(p[-1]).endswith("_lora_b") and not np.array_equal(after[p], before[p])]
    assert len(b_changed) == len(adapters) // 2
    # Gradients and optimizer state exist for the adapters only.
    assert set(_host(trainer.actor.params)) == set(adapters)
    mu = [s for s in jax.tree.leaves(trainer.actor.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)][0].mu
    assert set(_host(mu)) == set(adapters)


def test_reference_is_the_base_model_without_a_second_copy(run):
    trainer, _, _, copies = run
    frozen = jax.tree.leaves(trainer.actor.frozen)
    ref = jax.tree.leaves(trainer.ref.state())
    assert len(ref) == len(frozen) and {id(x) for x in ref} == {id(x) for x in frozen}
    assert all(not x.is_deleted() for x in ref)
    unique = {id(x): x for x in jax.tree.leaves(trainer.actor.state()) + ref}
    base_bytes = sum(x.nbytes for x in frozen)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.actor.params))
    assert sum(x.nbytes for x in unique.values()) == base_bytes + adapter_bytes
    assert adapter_bytes < 0.2 * base_bytes
    # One embedding table on the devices for actor + reference, before and after training (the sampler's merged
    # weights are temporary; the tied embedding has no adapter, so the merge shares it too).
    assert copies == {"built": 1, "trained": 1}
    # The sampler's merged weights are new arrays for the adapted projections only.
    sampler = dict(nnx.to_flat_state(trainer.rollouts._sampler_params()))
    for path, var in nnx.to_flat_state(trainer.actor.frozen):
        adapted = str(path[-1]) in lora.PROJECTIONS
        assert (sampler[path].get_value() is var.get_value()) != adapted, path
    # The reference's log-probs are the base model's: the adapters are off.
    ids = jnp.asarray([[5, 9, 12, 33, 7]], jnp.int32)
    base = nnx.merge(lora.plain_graphdef(trainer.actor.config, trainer.actor.task), trainer.actor.frozen)
    np.testing.assert_array_equal(np.asarray(trainer.ref.model()(ids)), np.asarray(base(ids)))
    assert np.abs(np.asarray(trainer.actor.model()(ids)) - np.asarray(base(ids))).max() > 1e-4


def test_exports_merged_model_and_peft_adapter(run, tmp_path):
    import peft

    trainer, out, _, _ = run
    export = os.path.join(out, "hf", "global_step_3")
    ids = np.asarray([[5, 9, 12, 33, 7, 100, 3]], np.int64)
    ours = np.asarray(trainer.actor.model()(jnp.asarray(ids, jnp.int32)))
    merged = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(trainer.c.model_path).eval()
    adapted = peft.PeftModel.from_pretrained(base, os.path.join(export, "lora_adapter")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(merged(input_ids=torch.tensor(ids)).logits.numpy(), ours, atol=1e-4)
        np.testing.assert_allclose(adapted(input_ids=torch.tensor(ids)).logits.numpy(), ours, atol=1e-4)
    # The checkpoint holds the adapters, not the base weights: the arrays it records are the adapters' bytes
    # exactly (read from Orbax's metadata: file sizes vary with how its writes split into files under load).
    saved = ocp.StandardCheckpointer().metadata(os.path.join(out, "checkpoints", "3", "actor_params"))
    stored = sum(int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize
                 for m in jax.tree.leaves(getattr(saved, "item_metadata", saved)))
    assert stored == sum(x.nbytes for x in jax.tree.leaves(trainer.actor.params)), stored
    assert stored < sum(x.nbytes for x in jax.tree.leaves(trainer.actor.frozen))
    # The export tool writes the same from the checkpoint (the base weights read from the base model).
    proc = run_tool("rlhf_jax.export", "--checkpoint", os.path.join(out, "checkpoints"), "--out", str(tmp_path / "x"),
                    env={"JAX_PLATFORMS": "cpu"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tool = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "x")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(tool(input_ids=torch.tensor(ids)).logits.numpy(), ours, atol=1e-4)
    assert sorted(os.listdir(tmp_path / "x" / "lora_adapter")) == ["adapter_config.json", "adapter_model.safetensors"]


def test_continue_from_adapter_and_resume(run, tmp_path):
    trainer, out, _, _ = run
    adapters = _host(trainer.actor.params)
    adapter_dir = os.path.join(out, "hf", "global_step_3", "lora_adapter")
    again = Trainer(make_config(str(tmp_path / "again"), "grpo", **LORA,
                                **{"actor_rollout_ref.model.lora_adapter_path": adapter_dir}))
    for p, v in _host(again.actor.params).items():
        np.testing.assert_array_equal(v, adapters[p], err_msg=str(p))
    again.close()
    # Resuming the run restores the adapters and keeps the reference sharing the base arrays.
    resumed = Trainer(make_config(out, "grpo", **LORA, **{"trainer.total_training_steps": 4}))
    resumed.loop.resume(resumed)
    assert resumed.loop.step == 3
    for p, v in _host(resumed.actor.params).items():
        np.testing.assert_array_equal(v, adapters[p], err_msg=str(p))
    assert {id(x) for x in jax.tree.leaves(resumed.ref.state())} == {id(x) for x in jax.tree.leaves(resumed.actor.frozen)}
    resumed.close()


@pytest.mark.parametrize("overrides, message", [
    ({"actor_rollout_ref.model.target_modules": ("q_proj", "attn_out")},
     r"actor_rollout_ref\.model\.target_modules: no module named 'attn_out'"),
    ({"actor_rollout_ref.actor.freeze.freeze_emb": True}, r"unset actor_rollout_ref\.actor\.freeze"),
    ({"actor_rollout_ref.model.lora_alpha": 0.0}, r"actor_rollout_ref\.model\.lora_alpha=0\.0 must be > 0"),
])
def test_bad_lora_settings_stop_before_loading(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        Trainer(make_config(str(tmp_path / "run"), "grpo", **{**LORA, **overrides}))


def test_lora_actor_in_ppo_with_padded_passes(tmp_path):
    """Another recipe (GAE with a fully trained critic) and the padded (unpacked) training passes."""
    trainer = Trainer(make_config(str(tmp_path / "ppo"), "ppo", **LORA,
                                  **{"actor_rollout_ref.model.use_remove_padding": False,
                                     "trainer.critic_warmup": 0}))
    before = _host(trainer.actor.state())
    critic_before = _host(trainer.critic.state())
    last = trainer.fit()
    assert np.isfinite(last["actor/pg_loss"]) and np.isfinite(last["critic/vf_loss"])
    after = _host(trainer.actor.state())
    for p in before:
        if not lora.is_adapter(p):
            np.testing.assert_array_equal(after[p], before[p], err_msg=str(p))
        elif str(p[-1]).endswith("_lora_b"):
            assert not np.array_equal(after[p], before[p]), p
    assert not jax.tree.leaves(trainer.critic.frozen) and not any(lora.is_adapter(p) for p in critic_before)
    critic_after = _host(trainer.critic.state())
    assert any(not np.array_equal(critic_after[p], v) for p, v in critic_before.items())


def test_lora_on_moe_trains_only_the_adapters(tmp_path):
    """A Qwen3-MoE actor (a dense layer, a sparse one) under LoRA all-linear, replaying the sampler's routes (R3):
    one GRPO step moves the attention, router and per-expert adapters and no base weight; the sampler's merged
    weights fold every expert's delta."""
    from tests.train.helpers import tiny_hf_checkpoint

    model_dir = tiny_hf_checkpoint("Qwen3MoeConfig", "Qwen3MoeForCausalLM", str(tmp_path / "moe"), num_experts=8,
                                   num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                   mlp_only_layers=[1], initializer_range=0.1)
    trainer = Trainer(make_config(str(tmp_path / "run"), "grpo", **{**LORA,
        "actor_rollout_ref.model.path": model_dir, "actor_rollout_ref.actor.use_kl_loss": False,
        "trainer.total_training_steps": 1, "mesh.data": 1, "mesh.expert": 2,
        "actor_rollout_ref.actor.router_replay.mode": "R3"}))
    before = _host(trainer.actor.state())
    last = trainer.fit()
    assert np.isfinite(last["actor/pg_loss"])
    after = _host(trainer.actor.state())
    for p in before:
        if not lora.is_adapter(p):
            np.testing.assert_array_equal(after[p], before[p], err_msg=str(p))
    moved = {".".join(map(str, p[3:])) for p in before if str(p[-1]).endswith("_lora_b")
             and not np.array_equal(after[p], before[p])}
    assert {"self_attn.q_proj_lora_b", "mlp.gate_lora_b", "mlp.experts.gate_up_proj_lora_b",
            "mlp.experts.down_proj_lora_b"} <= moved, moved
    assert not any("mlp.gate_proj" in m for m in moved)  # layer 1's dense MLP has no adapter (PEFT's meaning)
    sampler = dict(nnx.to_flat_state(trainer.rollouts._sampler_params()))
    base = dict(nnx.to_flat_state(trainer.actor.frozen))
    experts = ("model", "layers", 0, "mlp", "experts")
    a, b = (trainer.actor.model().model.layers[0].mlp.experts.gate_up_proj_lora_a[...],
            trainer.actor.model().model.layers[0].mlp.experts.gate_up_proj_lora_b[...])
    expected = np.asarray(base[experts + ("up_proj",)].get_value()) + trainer.actor.config.lora.scale * np.einsum(
        "xer,xrf->xef", np.asarray(a), np.asarray(b)[:, :, 1])
    np.testing.assert_allclose(np.asarray(sampler[experts + ("up_proj",)].get_value()), expected, atol=1e-6)
    trainer.close()
