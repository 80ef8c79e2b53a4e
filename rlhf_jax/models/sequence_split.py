"""Context (sequence) parallelism: activations split along the sequence over the mesh's ``context`` axis.

A program that traces the model under ``sequence_split(mesh)`` states that its rows' length dimension lies on the
``context`` axis (the logical ``length`` of the rule table). The model then keeps its hidden states (B, T, E)
split along T (``split_length``), so each device holds T / context tokens of every activation, and attention
(``ulysses``) re-splits q, k and v from (batch, length on context, heads on tensor) to (batch, whole length, heads
on (tensor, context)) before it runs and the output back after: XLA inserts the two all-to-alls (DeepSpeed's
Ulysses). Without a stated split (the sampler, a single device, context 1) every function here returns its input.

Why Ulysses rather than ring attention: the attention code (dense, blockwise, the fused kernels) runs unchanged on
whole sequences with fewer heads, so packed rows (segment ids, prompt-shared rows, restarting positions), sliding
windows and soft-capping need nothing new; its traffic per layer is four all-to-alls of activations whose size
does not grow with the split, against a ring's context - 1 exchanges of every key/value block. Its limit is the
head count: the query heads must divide tensor x context (``check_heads``, which names mesh.context). Key/value
heads that do not divide it are repeated (GQA groups shrink: each copy serves fewer query heads) up to a count
that does; positions and segment ids follow q/k/v: split with the tokens outside attention, whole inside it.
Models whose query heads do not divide (SmolLM2: 9) take the other path, ``context_gather`` (queries stay split,
keys/values are gathered); ``SequenceSplit.attention_path`` chooses, following mesh.context_attention.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhf_jax.config.names import CONTEXT_ATTENTION
from rlhf_jax.parallel.mesh import DEFAULT_RULES, Rules, logical_to_spec

log = logging.getLogger(__name__)


def axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes of a PartitionSpec entry (None, one axis name or a tuple of them)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """Rows over mesh axes ``rows``, the length over ``length`` (context), heads over ``heads`` (tensor); ``rules``
    place the other logical axes (``constrain``)."""

    mesh: Mesh
    rows: Any
    length: Any
    heads: Any
    rules: Rules = DEFAULT_RULES

    @property
    def length_axes(self) -> tuple[str, ...]:
        """The mesh axes the sequence is split over (the context axis)."""
        return axes_of(self.length)

    @property
    def ways(self) -> int:
        """Devices one sequence is split over."""
        return math.prod(self.mesh.shape[a] for a in self.length_axes)

    @property
    def head_ways(self) -> int:
        """Devices the heads are split over inside attention (tensor x context)."""
        return math.prod(self.mesh.shape[a] for a in axes_of(self.heads) + axes_of(self.length))

    def _constrain(self, x: jax.Array, *spec) -> jax.Array:
        spec = spec + (None,) * (x.ndim - len(spec))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*spec)))

    def kv_repeats(self, num_heads: int, num_kv_heads: int) -> int:
        """How often each key/value head is repeated so that the heads split over tensor x context (1: none)."""
        ways, group = self.head_ways, num_heads // num_kv_heads
        if num_heads % ways:
            raise ValueError(check_heads_message(num_heads, self.ways, ways // self.ways))
        return next(r for r in range(1, group + 1) if group % r == 0 and (num_kv_heads * r) % ways == 0)

    def attention_path(self, requested: str, num_heads: int) -> str:
        """"ulysses" or "gather" for ``requested`` (mesh.context_attention): "auto" is Ulysses where the query heads
        divide tensor x context, else the key/value gather (``context_gather``); "ulysses" that cannot is refused."""
        if requested not in CONTEXT_ATTENTION:
            raise ValueError(f"mesh.context_attention={requested!r} is not one of {', '.join(CONTEXT_ATTENTION)}")
        divides = num_heads % self.head_ways == 0
        if requested == "ulysses" and not divides:
            raise ValueError(check_heads_message(num_heads, self.ways, self.head_ways // self.ways))
        chosen = requested if requested != "auto" else "ulysses" if divides else "gather"
        _log_path(chosen, requested, num_heads, self.ways, self.head_ways // self.ways)
        return chosen


@functools.cache
def _log_path(chosen: str, requested: str, num_heads: int, context: int, tensor: int) -> None:
    why = {"ulysses": "the heads split over tensor x context", "gather": "keys/values gathered over context"}[chosen]
    log.info("mesh.context=%d attention: %s (%s; mesh.context_attention=%s, %d query heads, mesh.tensor=%d)",
             context, chosen, why, requested, num_heads, tensor)


def check_heads_message(num_heads: int, context: int, tensor: int) -> str:
    return (f"mesh.context={context} x mesh.tensor={tensor} does not divide the model's {num_heads} attention "
            f"heads (Ulysses attention splits the heads over both); choose a mesh.context that does, or "
            f"mesh.context_attention=gather (or auto)")


def check_heads(num_heads: int, context: int, tensor: int, path: str = "ulysses") -> None:
    """Refuse, naming mesh.context, Ulysses attention (``path``, mesh.context_attention) for a split whose attention
    heads cannot be divided over tensor x context; "auto" and "gather" run such a split by gathering keys/values."""
    if path == "ulysses" and context > 1 and num_heads % (context * tensor):
        raise ValueError(check_heads_message(num_heads, context, tensor))


_SPLIT: contextvars.ContextVar[SequenceSplit | None] = contextvars.ContextVar("sequence_split", default=None)


def layout_for(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> SequenceSplit | None:
    """The split ``mesh`` and ``rules`` give the training passes (None where the length is not split)."""
    split = _layout(mesh, rules)
    return split if split.ways > 1 else None


def _layout(mesh: Mesh, rules: Rules) -> SequenceSplit:
    rows, length, heads = logical_to_spec(("batch", "length", "heads"), rules, mesh)
    return SequenceSplit(mesh, rows, length, heads, tuple(rules))


@contextlib.contextmanager
def sequence_split(mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """While tracing inside it, the model keeps its activations laid out as ``rules`` place them on ``mesh``: rows
    over the batch axes, split along the sequence over ``context`` where that axis is larger than 1."""
    token = _SPLIT.set(_layout(mesh, rules))
    try:
        yield
    finally:
        _SPLIT.reset(token)


def current() -> SequenceSplit | None:
    """The sequence split of the pass being traced (None without one: context 1, the sampler, no mesh)."""
    layout = _SPLIT.get()
    return layout if layout is not None and layout.ways > 1 else None


def on_mesh() -> SequenceSplit | None:
    """The layout of the pass being traced where it runs on a mesh of several devices (any split), else None."""
    layout = _SPLIT.get()
    return layout if layout is not None and layout.mesh.size > 1 else None


def shards_weights() -> bool:
    """Whether the pass being traced runs on a mesh of several devices (where weights may be sharded, and gathered)."""
    return on_mesh() is not None


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """``x`` laid out along the logical axes ``names`` (one per leading dimension; None: whole) on the traced pass's
    mesh, ``x`` itself outside a training pass. Stated for the activations of every layer because sharding
    propagation alone may choose otherwise: with FSDP (weights split over the input dimension, rows over the same
    axis) XLA:GPU split the matmuls' contraction and kept every device's partial (rows, T, mlp) products of the
    whole batch (a 7B update at one 4096-token row needed 62 GiB of temporaries per H100) instead of gathering
    each weight. A dimension the mesh axes do not divide stays whole (``logical_to_spec``)."""
    layout = _SPLIT.get()
    if layout is None:
        return x
    names = names + (None,) * (x.ndim - len(names))
    spec = logical_to_spec(names, layout.rules, layout.mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))


def split_length(x_BT: jax.Array) -> jax.Array:
    """A (B, T, ...) activation (hidden states, positions, segment ids) with its rows over the batch axes, split
    along T over the context axis (kept whole where the split does not divide T: rows are padded to widths that
    powers of two divide, so rarely)."""
    split = current()
    if split is not None and x_BT.shape[1] % split.ways:
        _warn_indivisible(x_BT.shape[1], split.ways)
        return constrain(x_BT, "batch")
    return constrain(x_BT, "batch", "length")


@functools.cache
def _warn_indivisible(length: int, ways: int) -> None:
    log.warning("rows of %d tokens do not split over mesh.context=%d: that pass keeps whole sequences per device",
                length, ways)


def split_list(x_NC: jax.Array) -> tuple[jax.Array, int]:
    """A (N, C, ...) per-row list (the positions a pass projects onto the vocabulary) as (N * ways, C / ways, ...)
    with the new rows on (rows, context), so each context device takes C / ways of every row's entries, and ``ways``
    (1, the input unchanged, without a split or where ``ways`` does not divide C). Undo with a reshape to (N, C)."""
    split = current()
    if split is None or x_NC.shape[1] % split.ways:
        return x_NC, 1
    N, C = x_NC.shape[:2]
    x = x_NC.reshape(N * split.ways, C // split.ways, *x_NC.shape[2:])
    return split._constrain(x, _entry(axes_of(split.rows) + axes_of(split.length))), split.ways


def ulysses_inputs(q_BTHD, k_BSKD, v_BSKD, extras: tuple) -> tuple:
    """(q, k, v, extras) laid out for attention over whole sequences: heads split over tensor x context (key/value
    heads repeated where too few), the (B, T) ``extras`` (mask, segment ids; None kept) whole along T."""
    split = current()
    if split is None:
        return q_BTHD, k_BSKD, v_BSKD, extras
    repeats = split.kv_repeats(q_BTHD.shape[2], k_BSKD.shape[2])
    # q, k and v are computed on each device's tokens and then exchanged (all-to-all): stated, since XLA would
    # otherwise gather the whole sequence's hidden states to project them (and keep them for the backward pass)
    length = split.length if q_BTHD.shape[1] % split.ways == 0 else None
    q_BTHD = split._constrain(q_BTHD, split.rows, length, split.heads)
    if repeats > 1:  # repeat each kv head in place: head j*r + i is head j, so query head h still reads its own
        k_BSKD, v_BSKD = jnp.repeat(k_BSKD, repeats, axis=2), jnp.repeat(v_BSKD, repeats, axis=2)
    k_BSKD, v_BSKD = (split._constrain(x, split.rows, length, split.heads) for x in (k_BSKD, v_BSKD))
    heads = _entry(axes_of(split.heads) + axes_of(split.length))
    q, k, v = (split._constrain(x, split.rows, None, heads) for x in (q_BTHD, k_BSKD, v_BSKD))
    extras = tuple(None if e is None else split._constrain(e, split.rows, None) for e in extras)
    return q, k, v, extras


def ulysses_output(out_BTHD: jax.Array) -> jax.Array:
    """Attention's (B, T, H, D) output back to the length split (heads on tensor only)."""
    split = current()
    if split is None:
        return out_BTHD
    length = split.length if out_BTHD.shape[1] % split.ways == 0 else None
    return split._constrain(out_BTHD, split.rows, length, split.heads)


def traced_with_split(fn, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """``fn`` whose trace (inside ``jax.jit``) runs under ``sequence_split(mesh, rules)``."""
    def run(*args, **kwargs):
        with sequence_split(mesh, rules):
            return fn(*args, **kwargs)

    return run
