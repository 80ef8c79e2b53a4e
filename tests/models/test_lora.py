"""LoRA adapters: the low-rank path equals the merged weights, and adapters round-trip with PEFT (torch)."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from rlhf_jax.models import from_pretrained, lora, lora_peft
from rlhf_jax.parallel import make_mesh
from tests.conftest import left_padded_batch

LENGTHS = [11, 7, 11, 3]


def _randomize_adapters(model, seed: int, scale: float = 0.2):
    """Non-zero B matrices (fresh ones are zero, which would make every comparison trivial)."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(model)
    out = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if lora.is_adapter(path):
            host = (scale * rng.standard_normal(value.shape)).astype(np.float32)
            var = var.replace(value=jax.device_put(host, value.sharding))
        out.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(out))


def _logits(model, ids, mask):
    return np.asarray(jax.jit(lambda m, i, a: m(i, a))(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))


def _torch_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float().numpy()


@pytest.mark.parametrize("kind, targets", [("llama", ("all-linear",)), ("qwen2", ("q_proj", "v_proj", "down_proj"))])
def test_adapter_forward_equals_merged_model(hf_checkpoint, kind, targets):
    path, _ = hf_checkpoint(kind)
    mesh = make_mesh(2, 2, 2)
    base = from_pretrained(path, mesh=mesh)
    spec = lora.LoraSpec(4, 8.0, lora.resolve_targets(targets))
    model = _randomize_adapters(lora.with_adapters(base, spec, mesh), seed=1)
    ids, mask = left_padded_batch(np.random.default_rng(2), 128, LENGTHS)
    adapted, merged, plain = (_logits(m, ids, mask) for m in (model, lora.merged_model(model), base))
    real = mask.astype(bool)
    assert np.abs(adapted - plain)[real].max() > 1e-2  # the adapters do change the model
    np.testing.assert_allclose(adapted[real], merged[real], atol=1e-5, rtol=0)
    # Adapters shard like the weights they modify (rank axis replicated).
    q = model.model.layers[0].self_attn
    if "q_proj" in spec.targets:
        assert q.q_proj_lora_a[...].sharding.spec[0] == q.q_proj[...].sharding.spec[0]
        assert q.q_proj_lora_b[...].sharding.spec[1:] == q.q_proj[...].sharding.spec[1:]


def test_merging_in_the_compute_dtype_changes_no_product(hf_checkpoint):
    """The sampler's merged copy made in its bfloat16 compute dtype: half the bytes of the float32 weights, and the
    same logits to the bit as the float32 merge that the model casts at use."""
    path, _ = hf_checkpoint("llama")
    mesh = make_mesh(2, 2, 2)
    spec = lora.LoraSpec(4, 8.0, lora.resolve_targets(("all-linear",)))
    model = _randomize_adapters(lora.with_adapters(from_pretrained(path, mesh=mesh), spec, mesh), seed=3)
    _, state = nnx.split(model)
    wide, narrow = lora.merged_weights(state, spec), lora.merged_weights(state, spec, dtype=jnp.bfloat16)
    assert {str(w.dtype) for w in wide.values()} == {"float32"} and {str(w.dtype) for w in narrow.values()} == {"bfloat16"}
    assert sum(w.nbytes for w in narrow.values()) * 2 == sum(w.nbytes for w in wide.values())
    graphdef = lora.plain_graphdef(model.config.replace(dtype=jnp.bfloat16), model.task)
    ids, mask = left_padded_batch(np.random.default_rng(4), 128, LENGTHS)
    logits = [_logits(nnx.merge(graphdef, lora.merged_state(state, spec, w)), ids, mask) for w in (wide, narrow)]
    assert np.abs(logits[0]).max() > 0
    np.testing.assert_array_equal(logits[0], logits[1])
    # never widened: a float32 "compute dtype" leaves bfloat16 weights bfloat16
    assert lora.narrower(jnp.bfloat16, jnp.float32) == jnp.bfloat16 and lora.narrower(jnp.float32, None) == jnp.float32


def test_fresh_adapters_change_nothing(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    mesh = make_mesh(2, 2, 2)
    base = from_pretrained(path, mesh=mesh)
    model = lora.with_adapters(base, lora.LoraSpec(8, 16.0, lora.PROJECTIONS), mesh)
    ids, mask = left_padded_batch(np.random.default_rng(3), 128, LENGTHS)
    np.testing.assert_array_equal(_logits(model, ids, mask), _logits(base, ids, mask))
    # Shared base arrays: adding adapters copies no weight.
    base_ids = {id(x) for x in jax.tree.leaves(nnx.state(base))}
    assert {id(x) for p, x in nnx.to_flat_state(nnx.state(model)) if not lora.is_adapter(p)} and all(
        id(v.get_value()) in base_ids for p, v in nnx.to_flat_state(nnx.state(model)) if not lora.is_adapter(p))


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     ["v_proj", "o_proj", "up_proj"]])
def test_peft_saved_adapter_loads_with_equal_logits(hf_checkpoint, tmp_path, targets):
    import peft

    path, torch_model = hf_checkpoint("llama")
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=targets, lora_dropout=0.0)
    peft_model = peft.get_peft_model(copy.deepcopy(torch_model), config)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn_like(p))
    peft_model.eval()
    adapter_dir = str(tmp_path / "adapter")
    peft_model.save_pretrained(adapter_dir)

    mesh = make_mesh(2, 2, 2)
    spec = lora_peft.spec_from_config(lora_peft.read_config(adapter_dir))
    assert (spec.rank, spec.alpha, set(spec.targets)) == (4, 12.0, set(targets))
    model = lora_peft.load_adapter(lora.with_adapters(from_pretrained(path, mesh=mesh), spec, mesh), adapter_dir)
    ids, mask = left_padded_batch(np.random.default_rng(4), 128, LENGTHS)
    real = mask.astype(bool)
    expected = _torch_logits(peft_model, ids, mask)
    assert np.abs(expected - _torch_logits(torch_model, ids, mask))[real].max() > 1e-2
    np.testing.assert_array_less(np.abs(_logits(model, ids, mask) - expected)[real].max(), 1e-4)


# (checkpoint, target_modules, mesh): a dense model on (data, fsdp, tensor), Mixture-of-Experts ones with their
# experts sharded (what PEFT adapts in each family: models/lora_targets.py).
PEFT_CASES = [("qwen2", ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"], dict(data=2, fsdp=2, tensor=2)),
              ("qwen3_moe", "all-linear", dict(data=1, fsdp=2, tensor=2, expert=2)),
              ("qwen3_moe", ["k_proj", "down_proj"], dict(data=1, fsdp=2, tensor=2, expert=2)),
              ("qwen3_moe", ["gate_proj", "up_proj", "gate"], dict(data=1, fsdp=2, tensor=2, expert=2)),
              ("qwen2_moe", "all-linear", dict(data=1, fsdp=2, tensor=2, expert=2))]


@pytest.mark.parametrize("kind, targets, axes", PEFT_CASES)
def test_our_adapter_loads_into_peft_with_equal_logits(hf_checkpoint, tmp_path, kind, targets, axes):
    import peft

    path, torch_model = hf_checkpoint(kind)
    mesh = make_mesh(axes["data"], axes["fsdp"], axes["tensor"], expert=axes.get("expert", 1))
    base = from_pretrained(path, mesh=mesh)
    spec = lora.LoraSpec(4, 6.0, lora.resolve_targets(targets, model_cfg=base.config))
    model = _randomize_adapters(lora.with_adapters(base, spec, mesh), seed=7)
    adapter_dir = lora_peft.save_adapter(model, str(tmp_path / "ours"), base_model=path)
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), adapter_dir).eval()
    ids, mask = left_padded_batch(np.random.default_rng(8), 128, LENGTHS)
    real = mask.astype(bool)
    expected = _torch_logits(peft_model, ids, mask)
    assert np.abs(expected - _torch_logits(torch_model, ids, mask))[real].max() > 1e-2
    # 1e-4: the base models agree to that (test_parity.py, test_moe.py)
    np.testing.assert_array_less(np.abs(_logits(model, ids, mask) - expected)[real].max(), 1e-4)
    # And back: our reader gives the same adapter arrays.
    again = lora_peft.load_adapter(lora.with_adapters(base, spec, mesh, seed=3), adapter_dir)
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(again))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p))


def test_unknown_target_module_is_named():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.target_modules: no module named 'qkv_proj'"):
        lora.resolve_targets(("q_proj", "qkv_proj"), key="actor_rollout_ref.model.target_modules")
