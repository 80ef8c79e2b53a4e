"""Training passes state their activations' layout: rows over the batch axes, whatever the weights' sharding.

With FSDP the weights are split over their input dimension on the same mesh axis as the rows. Left to sharding
propagation, XLA split the matmuls' contraction instead of gathering each weight, so every device computed partial
(rows, T, mlp) products of the whole batch: per-device temporaries grew with the number of devices (a 7B update at
one 4096-token row planned 62 GiB per H100). ``sequence_split.constrain`` states the layout in every layer.
"""

import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies

from rlhf_jax.models import from_hf_dict
from rlhf_jax.models.hf_import import build_abstract
from rlhf_jax.models.sharding import variable_sharding
from rlhf_jax.models.sequence_split import traced_with_split
from rlhf_jax.parallel import make_mesh
from rlhf_jax.parallel.mesh import DEFAULT_RULES, batch_sharding

# wide enough that the products, not the weights, dominate the temporaries
# Several processes (parallel test runs) may load libtpu at once; it takes a lock file otherwise.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

DIMS = dict(model_type="qwen2", vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
ROWS_PER_DEVICE, TOKENS = 2, 512


def update_temp_bytes(data: int, fsdp: int, dims: dict = DIMS, devices=None, tokens: int = TOKENS, **runtime) -> int:
    """XLA's per-device temporaries of forward + backward over ROWS_PER_DEVICE rows per device."""
    mesh = make_mesh(data=data, fsdp=fsdp, devices=(devices or jax.devices())[:data * fsdp])
    graphdef, state = nnx.split(build_abstract(from_hf_dict(dims, remat="full", **runtime), "causal_lm"))
    flat = [(path, var.replace(value=jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype,
                                                           sharding=variable_sharding(var, mesh, DEFAULT_RULES))))
            for path, var in nnx.to_flat_state(state)]
    state = nnx.from_flat_state(flat)
    ids = jax.ShapeDtypeStruct((ROWS_PER_DEVICE * data * fsdp, tokens), jnp.int32, sharding=batch_sharding(mesh, 2))

    def loss(state, ids):
        return jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, state)(ids).astype(jnp.float32))[..., 0])

    step = jax.jit(traced_with_split(jax.grad(loss), mesh))
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # another platform's executables cannot be read back
    try:
        return step.lower(state, ids).compile().memory_analysis().temp_size_in_bytes
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def test_fsdp_temporaries_do_not_grow_with_the_devices_the_batch_spans():
    replicated_weights = update_temp_bytes(data=8, fsdp=1)
    fsdp = update_temp_bytes(data=1, fsdp=8)
    print(f"per-device temp bytes: data=8 {replicated_weights}, fsdp=8 {fsdp}")
    assert fsdp < 1.3 * replicated_weights  # without the stated layout: 6.9x


def test_fsdp_layers_gather_their_weights_as_they_run_on_a_tpu_slice():
    """XLA:TPU started every layer's FSDP weight all-gather at the program's start (a 7B update at one 4096-token
    row planned 20 GiB of temporaries on v6e-8). A rematerialised layer's weights now wait for its input
    (``remat.after``), so only a layer or two are gathered at any time: on 8 wide layers over a v5e 2x2 slice the
    per-device temporaries are under two layers' gathered bf16 weights (without it: 164 MiB, between five and six layers')."""
    dims = dict(DIMS, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8)
    e, m = dims["hidden_size"], dims["intermediate_size"]
    layer_bf16 = 2 * (e * e * (2 + 2 * 2 / 8) + 3 * e * m)  # q, o; k, v at 2 of 8 heads; gate, up, down
    chips = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    temp = update_temp_bytes(1, 4, dims, devices=chips, tokens=128, dtype=jnp.bfloat16, attn_impl="dense")
    print(f"per-device temp {temp / 2**20:.1f} MiB, one layer's gathered weights {layer_bf16 / 2**20:.1f} MiB")
    assert temp < 2 * layer_bf16
