"""On a mesh the routed experts run per device: each device sorts and computes its own tokens' (token, choice)
pairs. Left to sharding propagation, the sort over the whole batch made every device compute every pair.

The per-device program equals the single program (outputs and gradients, float32, 1e-5) under a training pass's
layout (rows, context, the experts' width over tensor, LoRA adapters on both projections) and the sampler's
(``tokens_on``), and its per-device temporaries do not grow with the devices the batch spans."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlhf_jax.models import from_hf_dict
from rlhf_jax.models.hf_import import build_abstract
from rlhf_jax.models.moe import routed_experts, tokens_on
from rlhf_jax.models.sequence_split import sequence_split, traced_with_split
from rlhf_jax.models.sharding import variable_sharding
from rlhf_jax.parallel import make_mesh
from rlhf_jax.parallel.mesh import DEFAULT_RULES, batch_sharding

B, T, E, X, K, F, R = 4, 8, 16, 8, 2, 12, 4


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1),  # noqa: E731
                                        jnp.float32)
    x = normal(B, T, E)
    ids = jnp.asarray(np.stack([rng.choice(X, K, replace=False) for _ in range(B * T)]).reshape(B, T, K), jnp.int32)
    weights = jnp.asarray(rng.dirichlet(np.ones(K), size=(B, T)), jnp.float32)
    experts = (normal(X, E, F), normal(X, E, F), normal(X, F, E))
    adapters = {"gate_up_proj": (normal(X, E, R), normal(X, R, 2, F)), "down_proj": (normal(X, F, R), normal(X, R, E))}
    return x, ids, weights, experts, adapters


def _loss(x, experts, adapters, ids, weights):
    out = routed_experts(x, ids, weights, *experts, jax.nn.silu, jnp.float32, adapters, 0.5)
    return jnp.sum(jnp.sin(out)), out  # sin: a gradient that differs per element


@pytest.mark.parametrize("layout", ["training", "sampler"])
def test_per_device_experts_equal_one_program(layout):
    x, ids, weights, experts, adapters = _inputs(3)
    run = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1, 2), has_aux=True))
    (_, expected), expected_grads = run(x, experts, adapters, ids, weights)
    if layout == "training":  # rows over data, the length over context, the experts' width over tensor
        mesh = make_mesh(data=2, fsdp=1, context=2, tensor=2, devices=jax.devices()[:8])
        context = sequence_split(mesh)
    else:  # the sampler's prefill and decode steps: rows over (data, fsdp), the width over tensor
        mesh = make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])
        context = tokens_on(mesh, ("data", "fsdp"))

    def split(*args):
        with context:
            return jax.value_and_grad(_loss, argnums=(0, 1, 2), has_aux=True)(*args)

    compiled = jax.jit(split).lower(x, experts, adapters, ids, weights).compile()
    assert "all-reduce" in compiled.as_text()  # the width's partial sums (and the weights' gradients)
    (_, out), grads = compiled(x, experts, adapters, ids, weights)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("data, fsdp, tensor", [(1, 8, 1), (2, 2, 2)])
def test_a_decode_step_uses_each_devices_slice_of_the_experts(data, fsdp, tensor):
    """A sampler decode step (one token per row) sends its tokens to the experts' E slices instead of gathering
    every expert weight (1.1 GiB a layer for Qwen3-30B-A3B): no all-gather in the program, the same outputs."""
    rng = np.random.default_rng(5)
    Bd, Xd, Ed, Fd = 16, 16, 64, 24
    x = jnp.asarray(rng.normal(size=(Bd, 1, Ed)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(Xd, K, replace=False) for _ in range(Bd)]).reshape(Bd, 1, K), jnp.int32)
    weights = jnp.asarray(rng.dirichlet(np.ones(K), size=(Bd, 1)), jnp.float32)
    experts = tuple(jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32)
                    for s in ((Xd, Ed, Fd), (Xd, Ed, Fd), (Xd, Fd, Ed)))
    expected = routed_experts(x, ids, weights, *experts, jax.nn.silu, jnp.float32)
    mesh = make_mesh(data=data, fsdp=fsdp, tensor=tensor, devices=jax.devices()[:8])
    placed = [jax.device_put(w, variable_sharding_of(mesh, axes)) for w, axes in
              zip(experts, (("expert", "embed", "mlp"), ("expert", "embed", "mlp"), ("expert", "mlp", "embed")))]

    def step(*args):
        with tokens_on(mesh, ("data", "fsdp")):
            return routed_experts(*args, jax.nn.silu, jnp.float32)

    compiled = jax.jit(step).lower(x, ids, weights, *placed).compile()
    assert "all-gather" not in compiled.as_text()
    np.testing.assert_allclose(compiled(x, ids, weights, *placed), expected, rtol=1e-5, atol=1e-6)


def variable_sharding_of(mesh, axes):
    from jax.sharding import NamedSharding

    from rlhf_jax.parallel.mesh import logical_to_spec
    return NamedSharding(mesh, logical_to_spec(axes, DEFAULT_RULES, mesh))


# a model whose routed experts dominate its temporaries
DIMS = dict(model_type="qwen3_moe", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, num_experts=16,
            num_experts_per_tok=2, moe_intermediate_size=128)


def _update_temp_bytes(data: int, layers: int = 1, fsdp: int = 1) -> int:
    """XLA's per-device temporaries of forward + backward over 2 rows of 256 tokens per device."""
    mesh = make_mesh(data=data, fsdp=fsdp, devices=jax.devices()[:data * fsdp])
    graphdef, state = nnx.split(build_abstract(from_hf_dict({**DIMS, "num_hidden_layers": layers}, remat="full"),
                                               "causal_lm"))
    flat = [(path, var.replace(value=jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype,
                                                           sharding=variable_sharding(var, mesh, DEFAULT_RULES))))
            for path, var in nnx.to_flat_state(state)]
    ids = jax.ShapeDtypeStruct((2 * data * fsdp, 256), jnp.int32, sharding=batch_sharding(mesh, 2))

    def loss(state, ids):
        return jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, state)(ids).astype(jnp.float32))[..., 0])

    step = jax.jit(traced_with_split(jax.grad(loss), mesh))
    return step.lower(nnx.from_flat_state(flat), ids).compile().memory_analysis().temp_size_in_bytes


def test_moe_temporaries_do_not_grow_with_the_devices_the_batch_spans():
    one, eight = _update_temp_bytes(1), _update_temp_bytes(8)
    print(f"per-device temp bytes: 1 device {one}, data=8 {eight}")
    assert eight < 1.3 * one  # with the pairs sorted over the whole batch: 6.8x


def test_each_further_moe_layer_keeps_only_its_input():
    """Rematerialised sparse layers over FSDP: a layer more adds about its saved input (2 rows x 256 tokens x 256
    float32 per device) and its router's outputs. The grouped products' padded buffers and their gradients' were
    plain zeros, which XLA created for every layer at the program's start: 35 times the input per layer here (a
    48-layer Qwen3-30B-A3B update on an H100 needed 1.7 GiB a layer)."""
    one, three = (_update_temp_bytes(1, layers, fsdp=8) for layers in (1, 3))
    layer_input = 2 * 256 * DIMS["hidden_size"] * 4
    print(f"per-device temp bytes: 1 layer {one}, 3 layers {three}; per layer {(three - one) / 2:.0f}, "
          f"input {layer_input}")
    assert (three - one) / 2 < 3 * layer_input
