"""A GRPO step of a Mixture-of-Experts actor on 1 device and on 8 fake devices with an expert axis of 4
(x tensor 2): the same samples, losses (router load-balancing loss included) and weights.

Both runs use padded rows: packed rows share a group's prompt among its samples, so the router loss (not a
sum over tokens) sees each prompt token once there, and n times in padded rows.

Qwen2-MoE is the family run here (shared expert, every layer sparse); Qwen3-MoE differs from it only inside the
model, whose sharded logits ``tests/models/test_moe.py`` compares (each run here takes minutes on CPU).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from rlhf_jax.models.safetensors_io import LazyFile
from tests.train.helpers import cli_args, read_metrics, run_main, tiny_hf_checkpoint

FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(shared_expert_intermediate_size=48,
                                                               decoder_sparse_step=1)),
}


def _moe_checkpoint(kind: str, out: str) -> str:
    """A tiny random MoE checkpoint whose config asks for the router loss (output_router_logits) with a
    coefficient of 0.05."""
    config_cls, model_cls, extra = FAMILIES[kind]
    return tiny_hf_checkpoint(config_cls, model_cls, out, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              output_router_logits=True, router_aux_loss_coef=0.05, initializer_range=0.1, **extra)


def _run(tmp_path, name: str, model_dir: str, devices: int, mesh: dict, packed: bool):
    out = str(tmp_path / name)
    args = cli_args(out, **{
        "actor_rollout_ref.model.path": model_dir,
        "actor_rollout_ref.model.use_remove_padding": packed,
        "trainer.total_training_steps": 1, "trainer.save_hf_checkpoint": "last",
        **{f"mesh.{axis}": size for axis, size in mesh.items()},
        # One mini-batch of all 8 sequences in one micro-batch: the router loss is formed per micro-batch.
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": -1,
    })
    proc = run_main(args, devices=devices)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(out)[0], LazyFile(os.path.join(out, "hf", "global_step_1", "model.safetensors"))


@pytest.mark.parametrize("kind", ["qwen2_moe"])
def test_moe_grpo_step_same_on_one_device_and_expert_parallel(tmp_path, kind):
    model_dir = _moe_checkpoint(kind, str(tmp_path / kind))
    one, one_params = _run(tmp_path, "one", model_dir, 1, dict(data=1, fsdp=1, tensor=1, expert=1), packed=False)
    eight, eight_params = _run(tmp_path, "eight", model_dir, 8, dict(data=1, fsdp=1, tensor=2, expert=4), packed=False)
    assert one["critic/score/mean"] == eight["critic/score/mean"]
    assert one["response_length/mean"] == eight["response_length/mean"]
    assert one["actor/router_aux_loss"] > 0
    loads = [one[f"actor/expert_load/{e}"] for e in range(8)]
    assert sum(loads) == pytest.approx(1.0, abs=1e-6) and max(loads) < 1.0
    keys = ["actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "actor/router_aux_loss",
            *(f"actor/expert_load/{e}" for e in range(8))]
    for key in keys:
        assert eight[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    # Adam's first step moves each weight by lr * g / (|g| + eps): where a gradient is at the level of rounding noise
    # (~1e-8) the two runs' steps differ by a part of lr = 1e-3 (seen: 1.7e-5 on one element of 2048), so the
    # weights are compared to a tenth of lr.
    for name in one_params.keys():
        np.testing.assert_allclose(eight_params.get(name), one_params.get(name), atol=1e-4, err_msg=name)


def _model_config(model_type: str, **hf):
    from rlhf_jax.models.config import from_hf_dict

    base = dict(model_type=model_type, vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4)
    return from_hf_dict({**base, **hf})


def test_router_aux_loss_coef_follows_the_checkpoint_unless_set():
    from tests.train.helpers import make_config

    from rlhf_jax.train.trainer import router_aux_loss_coef

    cfg = make_config("/tmp/unused")
    assert router_aux_loss_coef(cfg, _model_config("qwen3_moe", router_aux_loss_coef=0.02)) == 0.0
    assert router_aux_loss_coef(cfg, _model_config("qwen3_moe", router_aux_loss_coef=0.02,
                                                   output_router_logits=True)) == 0.02
    assert router_aux_loss_coef(cfg, _model_config("llama")) is None  # dense: no router statistics at all
    cfg.actor_rollout_ref.actor.router_aux_loss_coef = 0.3
    assert router_aux_loss_coef(cfg, _model_config("qwen2_moe")) == 0.3
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.3 applies to Mixture-of-Experts models"):
        router_aux_loss_coef(cfg, _model_config("llama"))


def test_expert_axis_must_divide_the_experts(tmp_path):
    import json

    from tests.train.helpers import make_config

    from rlhf_jax.train.setup import _check_mesh_axes

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 6}))
    cfg = make_config(str(tmp_path / "run"))
    cfg.mesh.expert = 3
    _check_mesh_axes(cfg, str(tmp_path))
    cfg.mesh.expert = 4
    with pytest.raises(ValueError, match=r"mesh.expert=4 does not divide the 6 experts"):
        _check_mesh_axes(cfg, str(tmp_path))
