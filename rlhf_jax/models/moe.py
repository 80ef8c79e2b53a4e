"""Mixture-of-Experts MLP block (Qwen3-MoE, Qwen2-MoE): a top-k router and dropless grouped experts.

Each token is routed to its ``num_experts_per_tok`` most probable experts, or replays recorded routes. The (token, choice) pairs are
sorted by expert so that each expert's tokens form one contiguous group, and every projection is one grouped
product over those groups (``grouped_dot``: ``jax.lax.ragged_dot`` on TPU and for few rows, blocks of one expert each otherwise):
every pair is computed (no capacity, nothing dropped) and no FLOPs go to experts a token did not pick. Qwen2-MoE adds a dense shared expert scaled by a sigmoid gate.
Under LoRA each expert has its own adapters, run as two more grouped products over the same groups; the router
and the shared-expert gate have plain ones (which modules PEFT adapts in each family: ``models/lora_targets.py``).

The block also returns the router's statistics over the real (unpadded) tokens, from which
``load_balancing_loss`` forms transformers' auxiliary loss and the trainer its per-expert load metrics.
Shapes: N tokens, E embed, X experts, K experts per token, F expert width.

On a mesh the routed experts run per device (``shard_map``), each device on its own tokens with the expert weights
gathered (their width split over ``tensor`` where it divides, the outputs then summed over it): sorting the
(token, choice) pairs is not something XLA can split over devices, so left to sharding propagation every device
sorted and computed the whole batch's pairs (on 8 devices, 6.8 times the temporaries of one at the same tokens per
device).

Routing replay (``actor_rollout_ref.actor.router_replay.mode``, verl's R2 / R3): a pass may be given recorded
expert ids per token (``forced_NK``; a row of -1 = none recorded, route natively) and every block returns the ids
it used, so one pass records what another replays. As verl's replay (Megatron's ``RouterReplay.get_replay_topk``:
``scores.gather(1, replayed indices)``), only the expert ids come from the record: the gate weights are the
router's current softmax probabilities at those ids (renormalized over the K when ``norm_topk_prob``), so the
router still learns through them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from rlhf_jax.models import grouped_dot, lora_layers, sequence_split
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.models.layers import ACTIVATION_FNS, MLP, param
from rlhf_jax.models.lora_targets import EXPERT_DOWN, EXPERT_GATE_UP, ROUTER, SHARED_GATE
from rlhf_jax.parallel.mesh import DEFAULT_RULES, logical_to_spec


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RouterStats:
    """Sums over the real tokens of every sparse layer of one forward pass (float32)."""

    counts_X: jax.Array  # top-k assignments per expert
    probs_X: jax.Array  # router probabilities per expert (differentiable)
    rows: jax.Array  # () token rows summed (real tokens x sparse layers)

    def __add__(self, other: "RouterStats") -> "RouterStats":
        return RouterStats(self.counts_X + other.counts_X, self.probs_X + other.probs_X, self.rows + other.rows)


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` (Switch Transformer eqs. 4-6) from the summed statistics:
    X * sum_x (assignment fraction of x) * (mean router probability of x), fractions over all rows."""
    rows = jnp.maximum(stats.rows, 1.0)
    return stats.counts_X.shape[-1] * jnp.sum((stats.counts_X / rows) * (stats.probs_X / rows))


def route(logits_NX: jax.Array, top_k: int, norm_topk_prob: bool, forced_NK: jax.Array | None = None):
    """(probabilities (N, X) float32, top-k weights (N, K) float32, top-k expert ids (N, K)), as transformers routes;
    with ``forced_NK`` the ids of its rows that hold a record (>= 0) replace the top-k, weighted by the current
    probabilities."""
    probs = jax.nn.softmax(logits_NX.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if forced_NK is not None:
        ids = jnp.where(forced_NK[:, :1] >= 0, forced_NK.astype(ids.dtype), ids)
        weights = jnp.take_along_axis(probs, ids, axis=-1)  # equal to top_k's where nothing is replayed
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, ids


def router_stats(probs_NX: jax.Array, ids_NK: jax.Array, valid_N: jax.Array) -> RouterStats:
    """Assignment counts and probability sums over the tokens where ``valid_N`` holds."""
    valid = valid_N.astype(jnp.float32)
    X = probs_NX.shape[-1]
    counts = jnp.sum(jax.nn.one_hot(ids_NK, X, dtype=jnp.float32) * valid[:, None, None], axis=(0, 1))
    return RouterStats(jax.lax.stop_gradient(counts), jnp.sum(probs_NX * valid[:, None], axis=0), jnp.sum(valid))


def grouped_experts(x_NE, ids_NK, weights_NK, gate_XEF, up_XEF, down_XFE, act, dtype, adapters=None,
                    scale: float = 1.0, summed=None) -> jax.Array:
    """sum_k weights[n, k] * expert_{ids[n, k]}(x[n]) for every token, dropless, (N, E).

    ``adapters``: LoRA factors per expert, ``{"gate_up_proj": (A (X, E, R), B (X, R, 2, F)), "down_proj": (A (X, F,
    r), B (X, r, E))}`` (either may be absent): each adds ``scale * (x A_x) B_x`` to its projection, as two grouped
    products over the same groups (no per-token W + A B is formed). ``summed``: applied to the gate and up products
    before the activation (a sum over the devices that each hold a slice of E), or None.
    """
    N, K = ids_NK.shape
    X = gate_XEF.shape[0]
    adapters = adapters or {}
    flat = ids_NK.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    groups = grouped_dot.plan(jnp.bincount(flat, length=X).astype(jnp.int32), N * K,
                              width=(gate_XEF.shape[1], gate_XEF.shape[2]))
    dot = lambda a, w: grouped_dot.dot(groups, a, w.astype(dtype))  # noqa: E731
    xs = jnp.take(x_NE, order // K, axis=0)  # (N*K, E)
    gate, up = dot(xs, gate_XEF), dot(xs, up_XEF)
    if summed is not None:
        gate, up = summed(gate), summed(up)
    if "gate_up_proj" in adapters:
        a, b = adapters["gate_up_proj"]
        h = dot(xs, a) * jnp.asarray(scale, dtype)  # (N*K, R)
        gate, up = gate + dot(h, b[:, :, 0]), up + dot(h, b[:, :, 1])
    hidden = act(gate) * up
    ys = dot(hidden, down_XFE)  # (N*K, E), sorted
    if "down_proj" in adapters:
        a, b = adapters["down_proj"]
        ys = ys + dot(dot(hidden, a) * jnp.asarray(scale, dtype), b)
    inverse = jnp.argsort(order)  # back to (token, choice) order: a gather, not a scatter-add
    ys = jnp.take(ys, inverse, axis=0).reshape(N, K, -1)
    return jnp.einsum("nke,nk->ne", ys, weights_NK.astype(dtype))


_SAMPLER_ROWS: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("moe_sampler_rows", default=None)


@contextlib.contextmanager
def tokens_on(mesh, rows, rules=DEFAULT_RULES):
    """While tracing inside it, the model's tokens lie with their rows over the mesh axes ``rows`` and its weights
    by ``rules`` (the sampler states this for its prefill and decode steps; training passes state their layout with
    ``sequence_split``)."""
    token = _SAMPLER_ROWS.set((mesh, rows, rules))
    try:
        yield
    finally:
        _SAMPLER_ROWS.reset(token)


def _token_layout(B: int, T: int, F: int):
    """(mesh, rows, length, width, rules) where the pass being traced holds (B, T) tokens on several devices: the
    mesh axes of the rows, of the length (context) and of the experts' width F (tensor; None where it does not
    divide), and the sharding rules of its weights; None without a stated layout, on one device, or where the axes
    do not divide B and T."""
    split = sequence_split.on_mesh()  # a training pass
    if split is not None:
        mesh, rows, length, rules = split.mesh, split.rows, split.length, split.rules
    elif (sampler := _SAMPLER_ROWS.get()) is not None and sampler[0].size > 1:
        (mesh, rows, rules), length = sampler, None
    else:
        return None
    ways = lambda entry: math.prod(mesh.shape[a] for a in sequence_split.axes_of(entry))  # noqa: E731
    if B % ways(rows) or T % ways(length):
        return None
    (width,) = logical_to_spec(("mlp",), rules, mesh, (F,))
    return mesh, rows, length, width, rules


def routed_experts(x_BTE, ids_BTK, weights_BTK, gate_XEF, up_XEF, down_XFE, act, dtype, adapters=None,
                   scale: float = 1.0) -> jax.Array:
    """``grouped_experts`` over (B, T) tokens, (B, T, E): per device on a mesh (each device sorts and computes its
    own tokens' pairs), as one program otherwise."""
    B, T, E = x_BTE.shape
    K = ids_BTK.shape[-1]

    def local(x, ids, weights, gate, up, down, adapters):
        b, t = x.shape[:2]
        out = grouped_experts(x.reshape(b * t, E), ids.reshape(b * t, K), weights.reshape(b * t, K), gate, up, down,
                              act, dtype, adapters, scale)
        return out.reshape(b, t, E)

    found = _token_layout(B, T, gate_XEF.shape[-1])
    if found is None:
        return local(x_BTE, ids_BTK, weights_BTK, gate_XEF, up_XEF, down_XFE, adapters or {})
    mesh, rows, length, width, rules = found
    embed = _stationary_axes(mesh, rules, length, B * T, K, gate_XEF.shape, adapters)
    if embed:
        return _weight_stationary(x_BTE, ids_BTK, weights_BTK, gate_XEF, up_XEF, down_XFE, act, dtype, mesh, rows,
                                  embed, width)
    tokens = PartitionSpec(rows, length, None)
    wide = {"gate_up_proj": (PartitionSpec(), PartitionSpec(None, None, None, width)),  # B (X, R, 2, F)
            "down_proj": (PartitionSpec(None, width, None), PartitionSpec())}  # A (X, F, r)
    adapter_specs = {name: wide[name] for name in (adapters or {})}

    def summed(*args):  # each device's share of the width gives a partial sum of the down projection
        out = local(*args)
        return out if width is None else jax.lax.psum(out, width)

    return jax.shard_map(summed, mesh=mesh, out_specs=tokens, check_vma=False, in_specs=(
        tokens, tokens, tokens, PartitionSpec(None, None, width), PartitionSpec(None, None, width),
        PartitionSpec(None, width, None), adapter_specs))(
        x_BTE, ids_BTK, weights_BTK, gate_XEF, up_XEF, down_XFE, adapters or {})


def _stationary_axes(mesh, rules, length, tokens: int, K: int, shape_XEF: tuple, adapters) -> tuple[str, ...]:
    """The mesh axes the experts' E is split over where a sampler step should bring its tokens to each device's
    slice of the weights rather than gather the weights (empty otherwise). A decode step routes a few tokens
    through every layer: gathering the experts (3 X E F per layer and step; Qwen3-30B-A3B: 1.1 GiB a layer in
    bfloat16) cost more than sending the tokens and summing their partial products (about tokens (2 E + 2 K F)),
    and XLA kept several layers' gathered experts alive at once. Training passes (and adapters, which the sampler
    never has: it runs merged weights) keep the gathered path."""
    if sequence_split.on_mesh() is not None or adapters or length is not None:
        return ()
    X, E, F = shape_XEF
    (embed,) = logical_to_spec(("embed",), rules, mesh, (E,))
    axes = sequence_split.axes_of(embed)
    if not axes or tokens * (2 * E + 2 * K * F) >= 3 * X * E * F:
        return ()
    return axes


def _weight_stationary(x_BTE, ids_BTK, weights_BTK, gate_XEF, up_XEF, down_XFE, act, dtype, mesh, rows, embed,
                       width) -> jax.Array:
    """``routed_experts`` with each device's slice of E of the weights where it lies: the tokens are gathered over
    the ``embed`` axes and split along E, every device sorts the same pairs, the gate and up products are summed
    over ``embed`` (and the down projection over ``width``), and each device returns its slice of E."""
    left = tuple(a for a in sequence_split.axes_of(rows) if a not in embed)
    rows_left = None if not left else left[0] if len(left) == 1 else left
    split_e = embed[0] if len(embed) == 1 else embed
    K = ids_BTK.shape[-1]

    def local(x, ids, weights, gate, up, down):
        b, t = x.shape[:2]
        out = grouped_experts(x.reshape(b * t, -1), ids.reshape(b * t, K), weights.reshape(b * t, K), gate, up, down,
                              act, dtype, summed=lambda y: jax.lax.psum(y, split_e))
        out = out if width is None else jax.lax.psum(out, width)
        return out.reshape(b, t, -1)

    tokens, pairs = PartitionSpec(rows_left, None, split_e), PartitionSpec(rows_left, None, None)
    return jax.shard_map(local, mesh=mesh, out_specs=tokens, check_vma=False, in_specs=(
        tokens, pairs, pairs, PartitionSpec(None, split_e, width), PartitionSpec(None, split_e, width),
        PartitionSpec(None, width, split_e)))(x_BTE, ids_BTK, weights_BTK, gate_XEF, up_XEF, down_XFE)


class Experts(nnx.Module):
    """The X experts' gated-MLP weights stacked on a leading ``expert`` axis (sharded by expert parallelism)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None):
        X, E, F, pd = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.param_dtype
        self.cfg = cfg
        self.gate_proj = param(rngs, (X, E, F), ("expert", "embed", "mlp"), pd)
        self.up_proj = param(rngs, (X, E, F), ("expert", "embed", "mlp"), pd)
        self.down_proj = param(rngs, (X, F, E), ("expert", "mlp", "embed"), pd)
        # LoRA as PEFT's ParamWrapper on transformers' fused gate_up_proj (gate and up share one rank-2r adapter,
        # B's outputs (2, F): gate, up) and on down_proj; see models/lora_targets.py.
        lora_layers.add_expert_adapters(self, cfg, rngs, {
            EXPERT_GATE_UP: ("gate_up_proj", X, E, (2, F), "embed", (None, "mlp")),
            EXPERT_DOWN: ("down_proj", X, F, (E,), "mlp", ("embed",))})

    def adapters(self) -> dict:
        """The LoRA factors ``grouped_experts`` takes (empty without adapters)."""
        found = {name: lora_layers.expert_factors(self, self.cfg, name) for name in ("gate_up_proj", "down_proj")}
        return {name: ab for name, ab in found.items() if ab is not None}


class SparseMoeBlock(nnx.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert); the MLP of a sparse decoder layer."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None):
        self.cfg = cfg
        # transformers' router is a (X, E) linear named ``gate``; ours is its (E, X) transpose.
        self.gate = param(rngs, (cfg.hidden_size, cfg.num_experts), ("embed", None), cfg.param_dtype)
        self.experts = Experts(cfg, rngs=rngs)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, width=cfg.shared_expert_intermediate_size, rngs=rngs)
            self.shared_expert_gate = param(rngs, (cfg.hidden_size, 1), ("embed", None), cfg.param_dtype)
        lora_layers.add_adapters(self, cfg, rngs, {
            ROUTER: ((cfg.hidden_size,), (cfg.num_experts,), ("embed",), (None,)),
            SHARED_GATE: ((cfg.hidden_size,), (1,), ("embed",), (None,))})

    def _linear(self, x_NE: jax.Array, name: str) -> jax.Array:
        """``x`` through the router or the shared-expert gate, with its LoRA path when adapted."""
        y = x_NE @ getattr(self, name)[...].astype(self.cfg.dtype)
        adapter = lora_layers.low_rank(self, self.cfg, name, x_NE, 1)
        return y if adapter is None else y + adapter

    def __call__(self, x_BTE: jax.Array, valid_BT: jax.Array | None = None, routes_BTK: jax.Array | None = None):
        """(output (B, T, E), RouterStats over the tokens where ``valid_BT`` holds or None without it, the expert
        ids used (B, T, K) int32); ``routes_BTK``: recorded ids to replay (-1 rows: route natively)."""
        cfg, dt = self.cfg, self.cfg.dtype
        B, T, E = x_BTE.shape
        K = cfg.num_experts_per_tok
        x = x_BTE.reshape(B * T, E)
        logits = self._linear(x, ROUTER)
        forced = None if routes_BTK is None else routes_BTK.reshape(B * T, K)
        probs, weights, ids = route(logits, K, cfg.norm_topk_prob, forced)
        # transformers casts the routing weights back to the hidden dtype before weighting the experts.
        ex = self.experts
        out = routed_experts(x_BTE, ids.reshape(B, T, K), weights.astype(dt).reshape(B, T, K), ex.gate_proj[...],
                             ex.up_proj[...], ex.down_proj[...], ACTIVATION_FNS[cfg.hidden_act], dt, ex.adapters(),
                             cfg.lora.scale if cfg.lora else 1.0).reshape(B * T, E)
        if cfg.shared_expert_intermediate_size:
            shared_gate = jax.nn.sigmoid(self._linear(x, SHARED_GATE))
            out = out + shared_gate * self.shared_expert(x)
        stats = None if valid_BT is None else router_stats(probs, ids, valid_BT.reshape(B * T))
        return out.reshape(B, T, E), stats, ids.reshape(B, T, K).astype(jnp.int32)
