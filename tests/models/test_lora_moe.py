"""LoRA on Mixture-of-Experts models (Qwen3-MoE, Qwen2-MoE): what PEFT adapts, the grouped low-rank expert path
against a float64 NumPy reference (values and gradients), merging, and adapters round-tripping with PEFT (torch)."""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rlhf_jax.models import from_hf_dict, from_pretrained, load_hf_config, lora, lora_peft, moe
from rlhf_jax.parallel import make_mesh
from tests.conftest import left_padded_batch
from tests.models.test_lora import LENGTHS, _logits, _randomize_adapters, _torch_logits

KINDS = ["qwen3_moe", "qwen2_moe"]
# PEFT's view of the tiny models (tests/conftest.py ARCHS); our spec for the same target_modules must match it.
EXPLICIT = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(torch_model, targets, seed: int):
    """PEFT's adapters on a copy of ``torch_model`` with random non-zero A and B (B starts at zero)."""
    import peft

    model = peft.get_peft_model(copy.deepcopy(torch_model), peft.LoraConfig(r=4, lora_alpha=12, target_modules=targets))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("targets", ["all-linear", EXPLICIT])
def test_targets_and_saved_config_are_pefts(hf_checkpoint, tmp_path, kind, targets):
    path, torch_model = hf_checkpoint(kind)
    peft_dir = str(tmp_path / "peft")
    _peft_model(torch_model, targets, seed=0).save_pretrained(peft_dir)
    theirs = json.load(open(f"{peft_dir}/adapter_config.json"))
    model_cfg = from_hf_dict(load_hf_config(path))
    spec = lora.LoraSpec(4, 12.0, lora.resolve_targets(targets, model_cfg=model_cfg))
    ours = lora_peft.peft_config(spec, None)
    for key in ("target_modules", "target_parameters"):
        assert sorted(ours.get(key) or []) == sorted(theirs.get(key) or []), key
    for key in ("rank_pattern", "alpha_pattern"):
        assert ours.get(key, {}) == theirs[key], key
    assert lora_peft.spec_from_config(theirs, model_cfg) == spec
    if kind == "qwen3_moe":  # experts, router; the dense MLP of mlp_only_layers is not adapted
        assert {"experts.gate_up_proj", "experts.down_proj"} <= set(spec.targets) and "gate_proj" not in spec.targets
    else:  # Linear modules only: shared expert and its gate, never the routed experts
        assert not any(t.startswith("experts.") or t == "gate" for t in spec.targets)


def test_half_a_fused_pair_is_refused(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3_moe")
    model_cfg = from_hf_dict(load_hf_config(path))
    with pytest.raises(ValueError, match=r"target_modules: gate_proj and up_proj are one fused parameter"):
        lora.resolve_targets(["q_proj", "gate_proj"], key="target_modules", model_cfg=model_cfg)
    with pytest.raises(ValueError, match=r"no module named 'shared_expert_gate' in the decoder of qwen3_moe"):
        lora.resolve_targets(["shared_expert_gate"], model_cfg=model_cfg)


@pytest.mark.parametrize("kind", KINDS)
def test_adapter_forward_equals_merged_model(hf_checkpoint, kind):
    path, _ = hf_checkpoint(kind)
    mesh = make_mesh(1, 2, 2, expert=2)
    base = from_pretrained(path, mesh=mesh)
    spec = lora.LoraSpec(4, 8.0, lora.resolve_targets("all-linear", model_cfg=base.config))
    model = _randomize_adapters(lora.with_adapters(base, spec, mesh), seed=1)
    ids, mask = left_padded_batch(np.random.default_rng(2), 128, LENGTHS)
    adapted, merged, plain = (_logits(m, ids, mask) for m in (model, lora.merged_model(model), base))
    real = mask.astype(bool)
    assert np.abs(adapted - plain)[real].max() > 1e-2
    np.testing.assert_allclose(adapted[real], merged[real], atol=1e-5, rtol=0)
    if kind == "qwen3_moe":  # expert adapters shard on the expert axis like their weights
        ex = model.model.layers[0].mlp.experts
        assert ex.gate_up_proj_lora_a[...].sharding.spec[0] == ex.gate_proj[...].sharding.spec[0] == "expert"
        assert ex.down_proj_lora_b[...].sharding.spec[0] == "expert"


@pytest.mark.parametrize("kind", KINDS)
def test_peft_saved_adapter_loads_with_equal_logits(hf_checkpoint, tmp_path, kind):
    path, torch_model = hf_checkpoint(kind)
    peft_model = _peft_model(torch_model, "all-linear", seed=5)
    adapter_dir = str(tmp_path / "adapter")
    peft_model.save_pretrained(adapter_dir)
    mesh = make_mesh(1, 2, 2, expert=2)
    base = from_pretrained(path, mesh=mesh)
    spec = lora_peft.spec_from_config(lora_peft.read_config(adapter_dir), base.config)
    model = lora_peft.load_adapter(lora.with_adapters(base, spec, mesh), adapter_dir)
    ids, mask = left_padded_batch(np.random.default_rng(4), 128, LENGTHS)
    real = mask.astype(bool)
    expected = _torch_logits(peft_model, ids, mask)
    assert np.abs(expected - _torch_logits(torch_model, ids, mask))[real].max() > 1e-1
    np.testing.assert_array_less(np.abs(_logits(model, ids, mask) - expected)[real].max(), 1e-4)  # the base models agree to 1e-4 (test_moe.py)


# Our adapters loading into PEFT: tests/models/test_lora.py (PEFT_CASES).


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _reference(x, ids, w, gate, up, down, ga, gb, da, db, scale):
    """float64: sum_k w[n, k] * expert_{ids[n, k]}(x[n]) with expert e's weights W_e + scale * A_e B_e."""
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[n, k]
            d_gate_up = scale * ga[e] @ gb[e].reshape(gb.shape[1], -1)  # (E, 2F): gate columns, then up
            F = gate.shape[-1]
            g = x[n] @ (gate[e] + d_gate_up[:, :F])
            u = x[n] @ (up[e] + d_gate_up[:, F:])
            out[n] += w[n, k] * ((_silu(g) * u) @ (down[e] + scale * da[e] @ db[e]))
    return out


def test_grouped_low_rank_experts_match_float64_reference():
    rng = np.random.default_rng(11)
    N, E, F, X, K, R, r, scale = 12, 16, 8, 4, 2, 6, 3, 1.7
    x = rng.standard_normal((N, E))
    ids = np.stack([rng.choice(X, K, replace=False) for _ in range(N)])
    w = rng.uniform(0.1, 1.0, (N, K))
    gate, up = 0.3 * rng.standard_normal((X, E, F)), 0.3 * rng.standard_normal((X, E, F))
    down = 0.3 * rng.standard_normal((X, F, E))
    ga, gb = 0.3 * rng.standard_normal((X, E, R)), 0.3 * rng.standard_normal((X, R, 2, F))
    da, db = 0.3 * rng.standard_normal((X, F, r)), 0.3 * rng.standard_normal((X, r, E))
    cot = rng.standard_normal((N, E))
    f32 = lambda a: jnp.asarray(a, jnp.float32)

    def loss(ga, gb, da, db):
        out = moe.grouped_experts(f32(x), jnp.asarray(ids), f32(w), f32(gate), f32(up), f32(down), jax.nn.silu,
                                  jnp.float32, {"gate_up_proj": (ga, gb), "down_proj": (da, db)}, scale)
        return jnp.sum(out * f32(cot)), out

    adapters = (ga, gb, da, db)
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*map(f32, adapters))
    np.testing.assert_allclose(np.asarray(out), _reference(x, ids, w, gate, up, down, *adapters, scale),
                               atol=1e-5, rtol=1e-5)
    # Gradients: the directional derivative along random directions, by central differences of the float64
    # reference (exact to ~1e-9 at this step).
    ref_loss = lambda *a: float(np.sum(_reference(x, ids, w, gate, up, down, *a, scale) * cot))
    eps = 1e-5
    for i, (value, grad) in enumerate(zip(adapters, grads)):
        for _ in range(2):
            v = rng.standard_normal(value.shape)
            plus = [a + eps * v if j == i else a for j, a in enumerate(adapters)]
            minus = [a - eps * v if j == i else a for j, a in enumerate(adapters)]
            numeric = (ref_loss(*plus) - ref_loss(*minus)) / (2 * eps)
            np.testing.assert_allclose(float(np.sum(np.asarray(grad) * v)), numeric, rtol=2e-4, atol=1e-4)
