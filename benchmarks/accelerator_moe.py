"""The accelerator benchmark's MoE section: one layer's routed experts, forward and backward, both grouped products.

``rlhf_jax.models.grouped_dot`` picks ``ragged_dot`` on TPU (XLA:TPU keeps it grouped) and blocks of one expert
each elsewhere (XLA:GPU and XLA:CPU expand ``ragged_dot`` over every expert). This measures both on the device, so
that the choice is a measurement: tokens/s, routed TFLOP/s and the peak memory of each, and how far their outputs
are apart (the same math in another order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.accelerator_parts import peak_memory_bytes, timed
from rlhf_jax.models import grouped_dot, moe


def routed_flops(tokens: int, top_k: int, hidden: int, width: int) -> float:
    """Forward + backward FLOPs of the routed products (gate, up, down; the backward twice the forward)."""
    return 3 * 2 * tokens * top_k * hidden * width * 3


def moe_products(*, tokens: int, experts: int, hidden: int, width: int, top_k: int, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.bfloat16)
    logits = rng.normal(size=(tokens, experts))
    ids = jnp.asarray(np.argsort(-logits, axis=1)[:, :top_k], jnp.int32)
    weights = jnp.asarray(rng.dirichlet(np.ones(top_k), size=tokens), jnp.bfloat16)
    scale = 1 / np.sqrt(hidden)
    gate, up = (jnp.asarray(rng.normal(size=(experts, hidden, width)) * scale, jnp.bfloat16) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(experts, width, hidden)) / np.sqrt(width), jnp.bfloat16)
    rows, outputs = [], {}
    for how in grouped_dot.IMPLEMENTATIONS:
        def loss(x, gate, up, down, how=how):
            with grouped_dot.using(how):
                out = moe.grouped_experts(x, ids, weights, gate, up, down, jax.nn.silu, jnp.bfloat16)
            return jnp.sum(out.astype(jnp.float32) ** 2), out

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        try:
            first, best, ((_, out), _) = timed(lambda: step(x, gate, up, down), repeats)
        except Exception as e:  # noqa: BLE001 - e.g. the expanded product out of memory: recorded, the other runs
            rows.append({"implementation": how, "error": f"{type(e).__name__}: {e}"[:500]})
            continue
        outputs[how] = np.asarray(out, np.float32)
        chosen = grouped_dot.implementation(jax.default_backend(), tokens * top_k, experts, (hidden, width))
        rows.append({"implementation": how, "chosen_here": how == chosen,
                     "tokens": tokens, "experts": experts, "hidden": hidden, "width": width, "top_k": top_k,
                     "first_call_s": first, "seconds": best, "tokens_per_s": tokens / best,
                     "routed_flops_per_s": routed_flops(tokens, top_k, hidden, width) / best,
                     "peak_memory_bytes": peak_memory_bytes()})
    if len(outputs) == 2:
        a, b = outputs.values()
        for r in rows:
            r["max_abs_diff_between"] = float(np.max(np.abs(a - b))) / float(np.max(np.abs(b)))
    return rows
