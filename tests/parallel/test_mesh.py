"""Mesh construction, logical rules, and sharded forwards equal to the single-device result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rlhf_jax.models import from_pretrained
from rlhf_jax.parallel import batch_sharding, logical_to_spec, make_mesh, resolve_axis_sizes
from tests.conftest import left_padded_batch


def test_resolve_axis_sizes():
    one = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1, "context": 1}
    assert resolve_axis_sizes({"data": 2, "fsdp": -1, "tensor": 2}, 8) == {**one, "data": 2, "fsdp": 2, "tensor": 2}
    assert resolve_axis_sizes({"fsdp": 8}, 8) == {**one, "fsdp": 8}
    assert resolve_axis_sizes({"data": 2, "expert": -1}, 8) == {**one, "data": 2, "expert": 4}
    assert resolve_axis_sizes({"data": 2, "context": -1}, 8) == {**one, "data": 2, "context": 4}
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        resolve_axis_sizes({"data": -1, "fsdp": -1}, 8)
    with pytest.raises(ValueError, match="3 devices"):
        resolve_axis_sizes({"data": 2, "fsdp": 2, "tensor": 2}, 3)
    with pytest.raises(ValueError, match="mesh.tensor=-1"):
        resolve_axis_sizes({"data": 3, "tensor": -1}, 8)


def test_logical_rules_and_indivisible_dims_replicate():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert logical_to_spec(("embed", "heads", "head_dim"), mesh=mesh, shape=(64, 4, 16)) == P("fsdp", "tensor", None)
    assert logical_to_spec(("batch", "length"), mesh=mesh, shape=(8, 5)) == P(("data", "fsdp"), None)
    split = make_mesh(data=2, fsdp=1, context=4)  # the sequence ("length") lies on the context axis
    assert logical_to_spec(("batch", "length"), mesh=split, shape=(8, 16)) == P("data", "context")
    # 9 heads (SmolLM2) do not split over tensor=2: that dimension is replicated instead of failing.
    assert logical_to_spec(("embed", "heads", "head_dim"), mesh=mesh, shape=(576, 9, 64)) == P("fsdp", None, None)


@pytest.mark.parametrize("axes", [dict(data=2, fsdp=2, tensor=2), dict(data=1, fsdp=8, tensor=1)])
def test_sharded_forward_equals_single_device(hf_checkpoint, axes):
    path, _ = hf_checkpoint("qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    ids, mask = left_padded_batch(np.random.default_rng(0), 128, [12, 7, 3, 12, 9, 1, 5, 12])
    single = from_pretrained(path)
    expected = np.asarray(single(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))

    mesh = make_mesh(**axes)
    model = from_pretrained(path, mesh=mesh)
    q = model.model.layers[0].self_attn.q_proj[...]
    gate = model.model.layers[0].mlp.gate_proj[...]
    assert len(q.sharding.device_set) == 8
    if axes["tensor"] == 2:
        assert q.sharding.spec == P("fsdp", "tensor", None) and gate.sharding.spec == P("fsdp", "tensor")
        assert q.addressable_shards[0].data.shape == (32, 2, 16)
    else:
        assert q.sharding.spec == P("fsdp", None, None)
        assert q.addressable_shards[0].data.shape == (8, 4, 16)
    # No device holds the whole parameter.
    assert all(s.data.size < q.size for s in q.addressable_shards)

    ids_s = jax.device_put(jnp.asarray(ids, jnp.int32), batch_sharding(mesh, 2))
    mask_s = jax.device_put(jnp.asarray(mask, jnp.int32), batch_sharding(mesh, 2))
    logits = jax.jit(lambda m, i, a: m(i, a))(model, ids_s, mask_s)
    np.testing.assert_allclose(np.asarray(logits)[mask.astype(bool)], expected[mask.astype(bool)], atol=1e-5)
