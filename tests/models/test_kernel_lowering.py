"""The attention and MoE kernels compile for a TPU v5e and an H100 on this CPU machine, without the hardware.

JAX compiles for a target it describes: a TPU slice from libtpu's topology, an H100 from the CUDA plugin
with XLA's GPU target description. Each test compiles a kernel (forward, and backward where training
uses it) for its target and checks that the compiled program holds the kernel itself (a Mosaic, Triton
or cuDNN custom call), not a fallback. A missing libtpu or CUDA plugin fails these tests; they do not skip.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhf_jax.models import TASK_CAUSAL_LM, attention_kernels, from_hf_dict, grouped_dot, moe
from rlhf_jax.models.decode_attention import decode_attention
from rlhf_jax.models.kernel_layout import kernel_layout
from rlhf_jax.models.hf_import import build_abstract
from rlhf_jax.parallel.backend import compiling_for
from rlhf_jax.parallel.mesh import single_device_mesh

# No CUDA driver here: the plugin's check of the local CUDA installation would refuse to start.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# Several processes (parallel test runs) may load libtpu at once; it takes a lock file otherwise.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# An H100 SXM as XLA describes it (xla/backends/gpu/target_config/specs/h100_sxm.txtpb, trimmed to what
# compilation reads: the compute capability, sizes and limits, the cuDNN version).
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84942979072 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

MOSAIC, TRITON, CUDNN = "tpu_custom_call", "__gpu$xla.gpu.triton", "__cudnn$fmha"


@pytest.fixture(scope="module", autouse=True)
def no_persistent_cache():
    """Executables for another platform cannot be read back from the on-disk cache: do not write them there."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", before)


@pytest.fixture(scope="module")
def tpu_slice():
    return topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices


@pytest.fixture(scope="module")
def tpu(tpu_slice):
    return tpu_slice[0]


@pytest.fixture(scope="module")
def h100():
    return topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=H100_TARGET).devices[0]


def compiled_hlo(device, fn, *args) -> str:
    """The optimized HLO of ``fn`` compiled for ``device`` from abstract ``args`` (shape/dtype structs)."""
    where = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where), args)
    return jax.jit(fn).lower(*abstract).compile().as_text()


def shapes(*specs):
    return tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs)


def decode_inputs(dtype, B=8, H=8, K=2, D=128, S=767):
    return shapes(((B, H, D), dtype), ((B, K, D, S), dtype), ((B, K, S, D), dtype), ((B,), jnp.int32), ((B, S), jnp.bool_))


def auto_decode(window):
    def run(q, k, v, q_slot, valid):
        with kernel_layout(single_device_mesh()):
            return decode_attention(q, k, v, q_slot, valid, q.dtype, window, softcap=20.0 if window else None)
    return run


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("window", [None, 64])
def test_decode_kernel_lowers_for_tpu(tpu, dtype, window):
    assert MOSAIC in compiled_hlo(tpu, auto_decode(window), *decode_inputs(dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("window", [None, 64])
def test_decode_kernel_lowers_for_h100(h100, dtype, window):
    assert TRITON in compiled_hlo(h100, auto_decode(window), *decode_inputs(dtype))


def test_decode_kernel_lowers_sharded_over_a_tpu_slice(tpu_slice):
    """On 2 x 2 chips, cache rows over one mesh axis and kv heads over the other: each chip runs the kernel on
    its own block of the cache (no all-gather of it)."""
    mesh = Mesh(np.array(tpu_slice).reshape(2, 2), ("data", "tensor"))
    q, k, v, q_slot, valid = decode_inputs(jnp.bfloat16, B=16)
    specs = (("data", "tensor"), ("data", "tensor"), ("data", "tensor"), ("data",), ("data",))
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))
            for a, spec in zip((q, k, v, q_slot, valid), specs)]

    def step(*a):
        with kernel_layout(mesh, "data", "tensor"):
            return decode_attention(*a, jnp.bfloat16, 64)

    hlo = jax.jit(step).lower(*args).compile().as_text()
    assert MOSAIC in hlo and "all-gather" not in hlo


def test_decode_kernels_lower_for_small_and_odd_shapes(tpu, h100):
    """One kv head per query head, a cache narrower than a block, 7 query heads per kv head (Qwen2.5-7B), head_dim
    256 (Gemma), head_dim 80 (TPU kernel; dense on GPU)."""
    small = decode_inputs(jnp.bfloat16, B=2, H=4, K=4, D=64, S=40)
    assert MOSAIC in compiled_hlo(tpu, auto_decode(None), *small)
    assert TRITON in compiled_hlo(h100, auto_decode(None), *small)
    qwen7b = decode_inputs(jnp.bfloat16, B=8, H=28, K=4, D=128, S=3071)  # 7 query heads per kv head
    gemma = decode_inputs(jnp.bfloat16, B=8, H=8, K=4, D=256, S=1000)
    for shapes_ in (qwen7b, gemma):
        assert MOSAIC in compiled_hlo(tpu, auto_decode(None), *shapes_)
        assert TRITON in compiled_hlo(h100, auto_decode(None), *shapes_)
    odd = decode_inputs(jnp.bfloat16, B=4, H=8, K=2, D=80, S=300)
    assert MOSAIC in compiled_hlo(tpu, auto_decode(8), *odd)
    assert TRITON not in compiled_hlo(h100, auto_decode(8), *odd)  # the dense path: Triton tiles need 2^n


def test_model_decode_step_uses_the_kernels(tpu, h100):
    """A whole decoder's one-token cached step, compiled for each target, runs the target's decode kernel."""
    hf = dict(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
    cfg = from_hf_dict(hf, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    graphdef, state = nnx.split(build_abstract(cfg, TASK_CAUSAL_LM))
    B, S = 8, 384

    def step(state, tokens, positions, valid):
        model = nnx.merge(graphdef, state)
        cache = model.init_cache(B, S)
        with kernel_layout(single_device_mesh()):
            hidden, _ = model.forward_cached(tokens, positions, valid, cache, S - 1)
        return model.logits_from_hidden(hidden)

    args = (state,) + shapes(((B, 1), jnp.int32), ((B, 1), jnp.int32), ((B, S), jnp.int32))
    assert compiled_hlo(tpu, step, *args).count(MOSAIC) >= 2  # one per layer
    assert compiled_hlo(h100, step, *args).count(TRITON) >= 2


def splash_train(q, k, v, valid):
    def loss(q, k, v):
        out = attention_kernels.splash_self_attention(q, k, v, valid, window=None, scale=0.125)
        return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def test_splash_attention_lowers_for_tpu(tpu):
    args = shapes(((2, 512, 8, 128), jnp.bfloat16), ((2, 512, 2, 128), jnp.bfloat16), ((2, 512, 2, 128), jnp.bfloat16),
                  ((2, 512), jnp.bool_))
    assert compiled_hlo(tpu, splash_train, *args).count(MOSAIC) >= 2  # forward and backward kernels


def cudnn_train(q, k, v, valid):
    def loss(q, k, v):
        out = attention_kernels.cudnn_self_attention(q, k, v, valid, window=None, scale=0.125)
        return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def test_cudnn_attention_lowers_for_h100(h100):
    args = shapes(((2, 512, 8, 128), jnp.bfloat16), ((2, 512, 2, 128), jnp.bfloat16), ((2, 512, 2, 128), jnp.bfloat16),
                  ((2, 512), jnp.bool_))
    hlo = compiled_hlo(h100, cudnn_train, *args)
    assert CUDNN in hlo and "__cudnn$fmhaSoftmaxBackward" in hlo


def moe_train(x, ids, weights, gate, up, down):
    def loss(x, gate, up, down):
        out = moe.grouped_experts(x, ids, weights, gate, up, down, jax.nn.silu, jnp.bfloat16)
        return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 3))(x, gate, up, down)


def moe_args(N=256, E=256, F=128, X=8, top=2):
    return shapes(((N, E), jnp.bfloat16), ((N, top), jnp.int32), ((N, top), jnp.float32), ((X, E, F), jnp.bfloat16),
                  ((X, E, F), jnp.bfloat16), ((X, F, E), jnp.bfloat16))


def test_moe_ragged_dot_lowers_for_tpu(tpu):
    """XLA:TPU runs the grouped products natively."""
    with compiling_for("tpu"):
        assert "ragged-dot" in compiled_hlo(tpu, moe_train, *moe_args())


def moe_temp_bytes(h100, how: str) -> int:
    args = moe_args(N=1024, E=512, F=256, X=64, top=4)
    where = NamedSharding(Mesh(np.array([h100]), ("x",)), PartitionSpec())
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where), args)
    with compiling_for("cuda"), grouped_dot.using(how):
        fresh = lambda *a: moe_train(*a)  # noqa: E731  (jax would reuse moe_train's trace of the other way)
        return jax.jit(fresh).lower(*abstract).compile().memory_analysis().temp_size_in_bytes


def test_moe_grouped_products_stay_grouped_on_h100(h100):
    """XLA:GPU expands ``ragged_dot`` into a dense product over every expert (each row in all X experts' slots), so
    GPUs take the blocked products: on 4096 (token, expert) pairs over 64 experts, 116 MiB of temporaries against
    900 MiB (the blocks' gathered weights are most of it; the expansion grows with the expert count)."""
    with compiling_for("cuda"):
        hlo = compiled_hlo(h100, moe_train, *moe_args())
    assert "ragged-dot" not in hlo and "ENTRY" in hlo
    blocked, ragged = moe_temp_bytes(h100, "blocked"), moe_temp_bytes(h100, "ragged")
    print(f"per-device temp bytes on H100: blocked {blocked}, ragged_dot {ragged}")
    assert blocked * 4 < ragged


def tiny_llama(T=256):
    hf = dict(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
    cfg = from_hf_dict(hf, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    graphdef, state = nnx.split(build_abstract(cfg, TASK_CAUSAL_LM))

    def grads(state, ids, mask):
        def loss(state):
            return jnp.mean(nnx.merge(graphdef, state)(ids, mask))
        return jax.grad(loss)(state)

    return grads, (state,) + shapes(((8, T), jnp.int32), ((8, T), jnp.int32))


def test_model_gradient_uses_splash_and_cudnn(tpu, h100):
    """The whole model's forward and backward, compiled for each target, runs the target's attention kernel."""
    grads, args = tiny_llama()

    def on_one_device(*a):
        with kernel_layout(single_device_mesh()):
            return grads(*a)

    assert compiled_hlo(tpu, on_one_device, *args).count(MOSAIC) >= 4  # two layers, forward and backward
    assert compiled_hlo(h100, on_one_device, *args).count(CUDNN) >= 4


def test_model_gradient_on_a_tpu_slice(tpu_slice):
    """Rows over data and heads over tensor on 2 x 2 chips: splash runs per chip inside a layout; without one
    the program takes XLA's attention (Mosaic kernels cannot be partitioned by XLA)."""
    mesh = Mesh(np.array(tpu_slice).reshape(2, 2), ("data", "tensor"))
    grads, (state, ids, mask) = tiny_llama()
    rows = NamedSharding(mesh, PartitionSpec("data"))
    ids, mask = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows) for a in (ids, mask))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())),
                         state)

    def in_layout(*a):
        with kernel_layout(mesh, "data", "tensor"):
            return grads(*a)

    assert jax.jit(in_layout).lower(state, ids, mask).compile().as_text().count(MOSAIC) >= 4
    assert MOSAIC not in jax.jit(grads).lower(state, ids, mask).compile().as_text()


def test_moe_decode_step_keeps_the_experts_in_place_on_a_tpu_slice(tpu_slice):
    """A sampler decode step of a MoE layer on 4 chips (experts split over fsdp) sends its tokens to each chip's
    slice of the experts (models/moe._weight_stationary) and runs the grouped products natively there: what is
    all-gathered is the tokens' routing (ids and weights, B x K), never expert weights, and the ragged dots stay."""
    from rlhf_jax.parallel import DEFAULT_RULES, logical_to_spec, make_mesh

    mesh = make_mesh(data=1, fsdp=4, tensor=1, devices=list(tpu_slice))
    B, X, E, F, K = 16, 16, 512, 128, 2

    def placed(shape, dtype, axes=None):
        spec = PartitionSpec() if axes is None else logical_to_spec(axes, DEFAULT_RULES, mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    tokens = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    args = (jax.ShapeDtypeStruct((B, 1, E), jnp.bfloat16, sharding=tokens),
            jax.ShapeDtypeStruct((B, 1, K), jnp.int32, sharding=tokens),
            jax.ShapeDtypeStruct((B, 1, K), jnp.float32, sharding=tokens),
            placed((X, E, F), jnp.bfloat16, ("expert", "embed", "mlp")),
            placed((X, E, F), jnp.bfloat16, ("expert", "embed", "mlp")),
            placed((X, F, E), jnp.bfloat16, ("expert", "mlp", "embed")))

    def step(*a):
        with moe.tokens_on(mesh, ("data", "fsdp")):
            return moe.routed_experts(*a, jax.nn.silu, jnp.bfloat16)

    with compiling_for("tpu"):
        hlo = jax.jit(step).lower(*args).compile().as_text()
    gathered = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in
                re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)]
    assert gathered and max(gathered) <= B * K, gathered  # routing only: an expert slice is X x E x F / 4
    assert "ragged-dot" in hlo
