"""Matrix products of low-precision operands with a float32 result.

On GPU and TPU ``preferred_element_type=float32`` makes the matmul unit accumulate bfloat16 /
float16 operands in float32 at no extra cost. XLA:CPU has no such dot outside a fusion: a
bfloat16 x bfloat16 = float32 dot that XLA leaves on its own (the sampler's prefill inside the
decode program is one) fails at run time with ``DotThunk ... Unsupported element type``. There the
operands are widened to float32 first, which is exact and gives the same float32 products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhf_jax.parallel.backend import compile_backend


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, a, b)`` accumulated and returned in float32 on every backend."""
    if compile_backend() == "cpu":
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
