"""Gradient checkpointing per decoder layer: same gradients, less memory, usable inside pure jax transforms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlhf_jax.models import from_hf_dict, init_model
from rlhf_jax.models.hf_import import build_abstract

TINY = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def tiny_config(layers: int = 2, **runtime):
    return from_hf_dict({**TINY, "num_hidden_layers": layers}, **runtime)


def graphdef_for(cfg):
    """The model structure for ``cfg`` without creating parameters (runtime settings live in it)."""
    return nnx.split(build_abstract(cfg, "causal_lm"))[0]


@pytest.fixture(scope="module")
def params():
    return nnx.split(init_model(tiny_config(), seed=1))[1]


def loss_fn(graphdef, ids, mask):
    def loss(state):
        logits = nnx.merge(graphdef, state)(ids, mask)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3] * mask)

    return loss


def test_config_accepts_policies_and_the_old_bool():
    assert tiny_config(remat=True).remat == "full"
    assert tiny_config(remat=False).remat == "none"
    assert tiny_config(remat="dots_saveable").remat == "dots_saveable"
    with pytest.raises(ValueError, match="remat"):
        tiny_config(remat="some")
    with pytest.raises(ValueError, match="attn_impl"):
        tiny_config(attn_impl="flash")


@pytest.mark.parametrize("attn_impl,policies", [("dense", ("full", "dots_saveable")), ("blockwise", ("full",))])
def test_remat_policies_give_the_same_gradients(params, attn_impl, policies):
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 96, (2, 24)), jnp.int32)
    mask = jnp.asarray(np.arange(24)[None, :] >= np.array([[0], [9]]), jnp.int32)  # row 1 left-padded
    plain = jax.jit(jax.grad(loss_fn(graphdef_for(tiny_config(attn_impl=attn_impl)), ids, mask)))(params)
    for policy in policies:
        remat_graphdef = graphdef_for(tiny_config(remat=policy, attn_impl=attn_impl))
        grads = jax.jit(jax.grad(loss_fn(remat_graphdef, ids, mask)))(params)
        for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(grads)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6 * np.abs(np.asarray(a)).max())


def test_remat_inside_lax_map_of_a_model_merged_outside(params):
    """The trainer's pattern: merge the model once, then call it per micro-batch inside lax.map under grad."""
    graphdef = graphdef_for(tiny_config(remat="full"))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 96, (3, 2, 10)), jnp.int32)

    def loss(state):
        model = nnx.merge(graphdef, state)
        per_micro = jax.lax.map(lambda i: jnp.mean(model(i)[..., 0]), ids)
        return per_micro.sum()

    grads = jax.jit(jax.grad(loss))(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def compiled_temp_bytes(remat: str, layers: int = 4, tokens: int = 128, attn_impl: str = "dense") -> int:
    """Temporary memory XLA plans for forward + backward of a model over 2 x ``tokens`` tokens."""
    graphdef, state = nnx.split(build_abstract(tiny_config(layers=layers, remat=remat, attn_impl=attn_impl),
                                               "causal_lm"))
    ids = jax.ShapeDtypeStruct((2, tokens), jnp.int32)

    def loss(state, ids):
        return jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, state)(ids))[..., 0])

    return jax.jit(jax.grad(loss)).lower(state, ids).compile().memory_analysis().temp_size_in_bytes


def test_full_remat_needs_less_temporary_memory():
    none, full = compiled_temp_bytes("none"), compiled_temp_bytes("full")
    print(f"temp bytes: none {none}, full {full}")
    assert full < 0.5 * none  # every layer's activations but one are recomputed instead of kept


def test_each_further_remat_layer_keeps_only_its_input():
    """Blockwise attention's loop buffers are made where its loops run: a layer more adds its saved input (the
    hidden states, 2 x 1024 x 64 float32) and nothing else. (When those buffers were plain zeros, XLA:CPU created
    every layer's at the program's start: 4x the input per layer, the key/value gradients among them.)"""
    two, eight = (compiled_temp_bytes("full", layers, tokens=1024, attn_impl="blockwise") for layers in (2, 8))
    layer_input = 2 * 1024 * TINY["hidden_size"] * 4
    print(f"temp bytes: 2 layers {two}, 8 layers {eight}; per layer {(eight - two) / 6:.0f}, input {layer_input}")
    assert (eight - two) / 6 < 1.25 * layer_input
