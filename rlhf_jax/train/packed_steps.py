"""Jittable training passes over packed micro-batches (see ``rlhf_jax.batch.packing``).

The model runs on packed rows (B', L) with segment ids and restarting positions;
the outputs (log-probs, entropies, values) of the states listed in the micro-batch's
``logit_positions`` are scattered through its ``logit_targets`` into the ordinary
(rows, R) grid of the mini-batch, and
the loss code of ``steps`` runs on that grid unchanged, with the mini-batch's
denominators. A micro-batch's mask on the grid is the response mask restricted to
the cells it filled, so summing its loss over micro-batches gives the mini-batch
loss exactly, and the gradients add up to the mini-batch gradient.

One call handles one micro-batch; the trainer loops over micro-batches in Python
(their number varies from step to step while their shape does not, so nothing
recompiles) and accumulates gradients in a donated buffer.

Routing replay (router_replay.mode): a micro-batch may carry ``routes``, the expert ids
(dp*M, L, sparse layers, K) its MoE layers replay, gathered from the batch's
(N, P + R, sparse layers, K) grid through ``route_sources`` (``gather_routes``); a
pass that records routes scatters the ids it used back onto that grid
(``scatter_routes``, then ``share_prompt_routes`` for prompts packed once for several
sequences).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlhf_jax import algos
from rlhf_jax.models.sequence_split import split_list
from rlhf_jax.train.steps import (ActorLossSpec, CriticLossSpec, actor_denominators, actor_loss, add_router_loss,
                                  add_value_loss, critic_loss, value_denominator)
from rlhf_jax.train.token_outputs import token_log_probs, token_top_k
from rlhf_jax.types import TrainBatch

Micro = dict[str, jax.Array]  # one packed micro-batch: MICRO_KEYS (and ROUTE_KEYS under routing replay)


# A packed micro-batch: (dp*M, L) int32 rows, and (dp*C,) lists of the states that predict a response token: their
# positions, the grid cells they fill and the tokens they predict.
ROW_KEYS = ("input_ids", "positions", "segment_ids")
LOGIT_KEYS = ("logit_positions", "logit_targets", "logit_token_ids")
MICRO_KEYS = ROW_KEYS + LOGIT_KEYS
# "routes" (dp*M, L, sparse layers, K): expert ids to replay; "route_sources" (dp*M, L): the sequence-grid cell of
# each position, for a pass that records its routes
ROUTE_KEYS = ("routes", "route_sources")


def topk_grids(grid_shape: tuple[int, int], k: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The (rows, R, k) grids a top-k pass fills: log-probs (float32) and token ids (int32)."""
    shape = (*grid_shape, k)
    return jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32)


def scatter_to_grid(values_BL: jax.Array, targets_BL: jax.Array, grid_shape: tuple[int, int], dp: int) -> jax.Array:
    """Per-entry values (one per target, each a scalar or a trailing (...) array) -> the (rows, R, ...) grid; shard
    d's entries fill shard d's block of grid rows.

    ``targets`` are flat indices into the shard's block (``local_row * R + t``), -1 for none.
    The scatter is batched over the shard axis, so it stays local to each shard.
    """
    rows, R = grid_shape
    block = rows // dp * R
    trailing = _trailing(values_BL, targets_BL.size)
    values = values_BL.reshape(dp, -1, *trailing)
    targets = targets_BL.reshape(dp, -1)
    targets = jnp.where(targets < 0, block, targets)  # out of range: dropped

    def one(v, t):
        return jnp.zeros((block, *trailing), v.dtype).at[t].set(v, mode="drop")

    return jax.vmap(one)(values, targets).reshape(rows, R, *trailing)


def gather_from_grid(grid: jax.Array, targets_BL: jax.Array, dp: int) -> jax.Array:
    """The (dp, C, ...) entries of the (rows, R, ...) grid at the ``targets`` of ``scatter_to_grid`` (an entry with
    no target reads a cell of its shard's block; it is never scattered back)."""
    rows, R, *trailing = grid.shape
    block = rows // dp * R
    flat = grid.reshape(dp, block, *trailing)
    where = jnp.clip(targets_BL.reshape(dp, -1), 0, block - 1)
    return jnp.take_along_axis(flat, where.reshape(where.shape + (1,) * len(trailing)), axis=1)


def _trailing(values: jax.Array, entries: int) -> tuple[int, ...]:
    """The dimensions of ``values`` after the leading ones that hold its ``entries`` entries."""
    lead, size = 0, 1
    while size < entries:
        size *= values.shape[lead]
        lead += 1
    return tuple(values.shape[lead:])


def gather_routes(routes_NTSK: jax.Array, sources_BL: jax.Array, dp: int) -> jax.Array:
    """The grid's expert ids (N, T, sparse layers, K) at each packed position (B', L, sparse layers, K); -1 (route
    natively) where the source is -1. Shard d's positions read shard d's block of grid rows (a local gather)."""
    tail = routes_NTSK.shape[2:]
    grid = routes_NTSK.reshape(dp, -1, *tail)
    sources = sources_BL.reshape(dp, -1)
    picked = jax.vmap(lambda g, s: jnp.take(g, jnp.maximum(s, 0), axis=0))(grid, sources)
    return jnp.where(sources[..., None, None] >= 0, picked, -1).reshape(*sources_BL.shape, *tail)


def scatter_routes(used_BLSK: jax.Array, sources_BL: jax.Array, routes_NTSK: jax.Array, dp: int) -> jax.Array:
    """``routes_NTSK`` with the expert ids used at each packed position written to its grid cell (each cell is
    packed at most once; padding positions are dropped)."""
    grid = routes_NTSK.reshape(dp, -1, *routes_NTSK.shape[2:])
    sources = sources_BL.reshape(dp, -1)
    sources = jnp.where(sources < 0, grid.shape[1], sources)  # out of range: dropped
    used = used_BLSK.reshape(dp, -1, *used_BLSK.shape[2:])
    grid = jax.vmap(lambda g, s, u: g.at[s].set(u, mode="drop"))(grid, sources, used)
    return grid.reshape(routes_NTSK.shape)


def share_prompt_routes(routes_NTSK: jax.Array, prompt_rows_N: jax.Array, prompt_width: int, dp: int) -> jax.Array:
    """Each sequence's prompt expert ids copied from the row whose prompt the packing computed (shard-local
    ``prompt_rows``): equal prompts are packed once per unit, so only its first sequence's cells were written."""
    N = routes_NTSK.shape[0]
    grid = routes_NTSK.reshape(dp, N // dp, *routes_NTSK.shape[1:])
    prompts = jax.vmap(lambda g, r: g[r, :prompt_width])(grid, prompt_rows_N.reshape(dp, -1))
    return grid.at[:, :, :prompt_width].set(prompts).reshape(routes_NTSK.shape)


def packed_hidden(model, micro: Micro, with_router_stats: bool = False, record_routes: bool = False):
    """Hidden states of the packed rows (and, ``with_router_stats``, the MoE router statistics; ``record_routes``,
    the expert ids used (B', L, sparse layers, K)); a MoE model replays the micro-batch's ``routes`` if any."""
    return model.hidden_states(micro["input_ids"], positions=micro["positions"], segment_ids=micro["segment_ids"],
                               with_router_stats=with_router_stats, routes=micro.get("routes"),
                               record_routes=record_routes)


def packed_log_probs(model, micro: Micro, temperature: float, with_entropy: bool, dp: int, with_router_stats=False,
                     with_sum_pi_squared: bool = False):
    """Log-prob (and entropy) of the next token at each of the micro-batch's ``logit_positions``; (dp, C) float32.

    Only those positions go through the vocabulary projection (prompt and padding positions do not).
    ``with_router_stats``: (that, the MoE router statistics over the real tokens).
    """
    if with_router_stats:
        hidden, stats = packed_hidden(model, micro, True)
        return _log_probs_at(model, hidden, micro, temperature, with_entropy, dp), stats
    return _log_probs_at(model, packed_hidden(model, micro), micro, temperature, with_entropy, dp, with_sum_pi_squared)


def _log_probs_at(model, hidden, micro: Micro, temperature: float, with_entropy: bool, dp: int,
                  with_sum_pi_squared: bool = False):
    # under a sequence split each context device projects C / context of the listed positions, not all of them
    picked, ways = split_list(pick(hidden, micro, dp))  # (dp * ways, C / ways, E)
    ids, _ = split_list(micro["logit_token_ids"].reshape(dp, -1))
    outs = token_log_probs(model, picked, ids, temperature, with_entropy, with_sum_pi_squared)
    return outs if ways == 1 else tuple(None if o is None else o.reshape(dp, -1) for o in outs)


def pick(per_position: jax.Array, micro: Micro, dp: int) -> jax.Array:
    """The (dp, C, ...) entries of per-position outputs (B', L, ...) at each shard's ``logit_positions``."""
    flat = per_position.reshape(dp, -1, *per_position.shape[2:])
    where = micro["logit_positions"].reshape(dp, -1)
    return jnp.take_along_axis(flat, where.reshape(where.shape + (1,) * (flat.ndim - 2)), axis=1)


def packed_values(model, micro: Micro, dp: int) -> jax.Array:
    """Critic values (dp, C) of the listed states (those before each response token)."""
    return pick(model.token_values(micro["input_ids"], positions=micro["positions"], segment_ids=micro["segment_ids"]),
                micro, dp)


def covered_mask(micro: Micro, grid_shape: tuple[int, int], dp: int) -> jax.Array:
    """1.0 on the grid cells this micro-batch fills."""
    targets = micro["logit_targets"]
    return scatter_to_grid((targets >= 0).astype(jnp.float32), targets, grid_shape, dp)


def forward_log_probs(graphdef, params, grid_acc, micro: Micro, *, temperature: float, dp: int,
                      sum_pi_squared: bool = False, topk: int = 0, record_routes: bool = False):
    """Add this micro-batch's response log-probs into ``grid_acc`` (rows, R) (donated, filled cell by cell); with
    ``sum_pi_squared`` the grids are a pair, the second for the sums of squared probabilities; ``topk`` > 0: a pair
    of (rows, R, k) grids for the top-k (log-probs, ids) of each position (``steps.response_top_k``).
    ``record_routes``: (that, the expert ids used at each packed position (B', L, sparse layers, K)): the caller
    scatters them onto the sequence grid, whose width (the batch's prompt width) this program's shapes do not
    depend on."""
    model = nnx.merge(graphdef, params)
    hidden = packed_hidden(model, micro, record_routes=record_routes)
    hidden, used = hidden if record_routes else (hidden, None)
    if topk or sum_pi_squared:
        parts = (token_top_k(model, pick(hidden, micro, dp), topk) if topk
                 else _log_probs_at(model, hidden, micro, temperature, False, dp, sum_pi_squared))
        out = tuple(acc + scatter_to_grid(x, micro["logit_targets"], acc.shape[:2], dp)
                    for acc, x in zip(grid_acc, parts))
    else:
        logp, _ = _log_probs_at(model, hidden, micro, temperature, False, dp)
        out = grid_acc + scatter_to_grid(logp, micro["logit_targets"], grid_acc.shape, dp)
    return (out, used) if record_routes else out


def forward_values(graphdef, params, grid_acc, micro: Micro, *, dp: int):
    """Add this micro-batch's critic values (of the states before each response token) into ``grid_acc``."""
    model = nnx.merge(graphdef, params)
    return grid_acc + scatter_to_grid(packed_values(model, micro, dp), micro["logit_targets"], grid_acc.shape, dp)


def actor_grads(graphdef, spec: ActorLossSpec, params, frozen, grad_acc, micro: Micro, grid: TrainBatch, key, *,
                dp: int):
    """Add one micro-batch's actor gradient into ``grad_acc``; returns (grad_acc, metrics, token count)."""
    mask = grid.response_mask.astype(jnp.float32)
    den, den_plain = actor_denominators(spec, mask)
    value_den = value_denominator(spec, mask)
    m_mask = mask * covered_mask(micro, mask.shape, dp)

    moe = spec.router_aux_loss_coef is not None

    def loss_fn(p):
        model = nnx.merge(graphdef, p, frozen)
        out = packed_hidden(model, micro, with_router_stats=moe)
        hidden, stats = out if moe else (out, None)
        picked = pick(hidden, micro, dp)  # (dp, C, E): the states that predict each listed token
        # the teacher's top-k tokens (forward_kl_topk) of each listed state, read back from the grid
        at = None if grid.teacher_topk_ids is None else gather_from_grid(grid.teacher_topk_ids, micro["logit_targets"],
                                                                          dp)
        outs = token_log_probs(model, picked, micro["logit_token_ids"].reshape(dp, -1), spec.temperature, True,
                               at_ids=at)
        to_grid = lambda x: scatter_to_grid(x, micro["logit_targets"], mask.shape, dp)  # noqa: E731
        logp, ent, *topk = (to_grid(x) for x in outs)
        loss, metrics = actor_loss(spec, logp, ent, grid, m_mask, den, den_plain, key, *topk)
        if moe:
            loss, metrics = add_router_loss(spec, loss, metrics, stats,
                                            jnp.sum(m_mask) / jnp.maximum(jnp.sum(mask), 1.0))
        if spec.value is not None:  # the value head on the same states, placed on the grid like the log-probs
            loss, metrics = add_value_loss(spec, to_grid(model.values_from_hidden(picked)), grid, m_mask, value_den,
                                           loss, metrics)
        return loss, metrics

    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(jnp.add, grad_acc, grads), aux, jnp.sum(m_mask)


def critic_grads(graphdef, spec: CriticLossSpec, params, frozen, grad_acc, micro: Micro, grid: TrainBatch, *,
                 dp: int):
    """Add one micro-batch's critic gradient into ``grad_acc``; returns (grad_acc, metrics, token count)."""
    mask = grid.response_mask.astype(jnp.float32)
    den = algos.loss_denominator(mask, spec.loss_agg_mode, norm_constant=spec.norm_constant)
    m_mask = mask * covered_mask(micro, mask.shape, dp)

    def loss_fn(p):
        model = nnx.merge(graphdef, p, frozen)
        values = scatter_to_grid(packed_values(model, micro, dp), micro["logit_targets"], mask.shape, dp)
        return critic_loss(spec, values, grid, m_mask, den)

    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(jnp.add, grad_acc, grads), aux, jnp.sum(m_mask)
