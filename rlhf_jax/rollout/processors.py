"""Logit processors (temperature, top-k, top-p): pure ``jnp`` functions, registered by name, composed in order.

A processor maps a :class:`Candidates` set to a smaller or rescaled one. The
set starts as the whole vocabulary (``token_ids`` None, ``logits`` (B, V));
top-k replaces it with the k best tokens, sorted; excluded entries carry
``-inf``. Working on candidate sets instead of always-(B, V) masks keeps the
decode step cheap: after top-k, top-p and the draw touch only k columns, and
nothing sorts the vocabulary when top-p is off.

Order matters and follows ``transformers``/vLLM: temperature, then top-k, then
top-p on the distribution renormalised over what top-k kept. Add a processor
with ``@register_processor("name")`` and list it in ``SamplingParams.processors``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from rlhf_jax.rollout.params import SamplingParams

NEG_INF = -jnp.inf
# top-p first looks for its nucleus among this many best tokens (exact whenever they hold the mass).
TOP_P_FAST_CANDIDATES = 256
_BISECTION_STEPS = 48


@struct.dataclass
class Candidates:
    """Tokens still allowed, with their (processed) logits; ``-inf`` marks an excluded entry."""

    logits: jax.Array  # (B, C) float32
    token_ids: jax.Array | None = None  # (B, C) int32 vocabulary ids; None: the whole vocabulary, C == V
    is_sorted: bool = struct.field(pytree_node=False, default=False)  # logits descending along C

    @classmethod
    def full(cls, logits_BV: jax.Array) -> "Candidates":
        return cls(logits=logits_BV.astype(jnp.float32))

    def vocab_ids(self, index_B: jax.Array) -> jax.Array:
        """Vocabulary id of the chosen candidate column of each row."""
        if self.token_ids is None:
            return index_B.astype(jnp.int32)
        return jnp.take_along_axis(self.token_ids, index_B[:, None], axis=1)[:, 0]


Processor = Callable[[Candidates, SamplingParams], Candidates]
PROCESSORS: dict[str, Processor] = {}


def register_processor(name: str) -> Callable[[Processor], Processor]:
    """Register ``fn(candidates, params) -> candidates`` under ``name``."""

    def deco(fn: Processor) -> Processor:
        if name in PROCESSORS:
            raise ValueError(f"logit processor {name!r} is already registered")
        PROCESSORS[name] = fn
        return fn

    return deco


def get_processor(name: str) -> Processor:
    if name not in PROCESSORS:
        raise ValueError(f"unknown logit processor {name!r}; registered: {sorted(PROCESSORS)}")
    return PROCESSORS[name]


def apply_processors(candidates: Candidates, params: SamplingParams) -> Candidates:
    """Run ``params.processors`` in order."""
    for name in params.processors:
        candidates = get_processor(name)(candidates, params)
    return candidates


def _select(candidates: Candidates, index_BC: jax.Array, logits_BC: jax.Array) -> Candidates:
    """The candidates at columns ``index_BC`` (whose logits are ``logits_BC``), sorted descending."""
    if candidates.token_ids is None:
        ids = index_BC.astype(jnp.int32)
    else:
        ids = jnp.take_along_axis(candidates.token_ids, index_BC, axis=1)
    return Candidates(logits=logits_BC, token_ids=ids, is_sorted=True)


@register_processor("temperature")
def temperature(candidates: Candidates, params: SamplingParams) -> Candidates:
    """Divide logits by the temperature (a no-op at 1; greedy decoding never reaches processors)."""
    if params.temperature in (0.0, 1.0):
        return candidates
    return candidates.replace(logits=candidates.logits / jnp.float32(params.temperature))


@register_processor("top_k")
def top_k(candidates: Candidates, params: SamplingParams) -> Candidates:
    """Keep the ``top_k`` largest logits (ties broken towards the lower index); off for -1 or 0."""
    k = int(params.top_k)
    if k <= 0 or k >= candidates.logits.shape[1]:
        return candidates
    if candidates.is_sorted:
        return Candidates(candidates.logits[:, :k], None if candidates.token_ids is None else candidates.token_ids[:, :k], True)
    values, index = jax.lax.top_k(candidates.logits, k)
    return _select(candidates, index, values)


def nucleus_mask_sorted(logits_BC: jax.Array, top_p: float) -> jax.Array:
    """For logits sorted descending: keep the smallest prefix whose probability reaches ``top_p``.

    An entry is kept when the mass strictly before it is below ``top_p``; the
    first entry is always kept. Returns the masked logits.
    """
    probs = jax.nn.softmax(logits_BC, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p) | (jnp.arange(logits_BC.shape[1]) == 0)[None, :]
    return jnp.where(keep, logits_BC, NEG_INF)


def nucleus_threshold_bisect(logits_BV: jax.Array, top_p: float) -> jax.Array:
    """The smallest logit ``t`` of the nucleus of each row, found without sorting (B,).

    Bisection on the threshold value: ``mass(logits >= t) >= top_p`` holds at the
    row maximum's lower side and fails above it; ``_BISECTION_STEPS`` halvings
    shrink the interval below float32 resolution, then the threshold snaps to
    the smallest logit inside the kept region. Pure and sort-free: (B, V) work per step.
    """
    probs = jax.nn.softmax(logits_BV, axis=-1)
    finite = jnp.isfinite(logits_BV)
    hi = jnp.max(logits_BV, axis=-1)  # mass(>= hi) may be < top_p; mass(>= lo) >= top_p always
    # below max - 100 the remaining mass is < V * e^-100, zero in float32, so lo starts valid
    lo = jnp.maximum(jnp.min(jnp.where(finite, logits_BV, jnp.inf), axis=-1), hi - 100.0)

    def mass_at(t_B):
        return jnp.sum(jnp.where(logits_BV >= t_B[:, None], probs, 0.0), axis=-1)

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) * 0.5
        ok = mass_at(mid) >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    top_ok = mass_at(hi) >= top_p
    lo, hi = jax.lax.fori_loop(0, _BISECTION_STEPS, step, (lo, hi))
    lo = jnp.where(top_ok, hi, lo)
    return jnp.min(jnp.where(logits_BV >= lo[:, None], logits_BV, jnp.inf), axis=-1)


@register_processor("top_p")
def top_p(candidates: Candidates, params: SamplingParams) -> Candidates:
    """Nucleus filtering; off at 1.0.

    On sorted candidates (after top-k) it is a cumulative sum over them. On the
    full vocabulary it takes the best ``TOP_P_FAST_CANDIDATES`` tokens and, for
    the rare rows whose nucleus is larger than that, falls back (``lax.cond``) to
    a sort-free bisection over the vocabulary. On the full vocabulary, tokens
    whose logit exactly equals the last nucleus token's are kept with it.
    """
    p = float(params.top_p)
    if p >= 1.0:
        return candidates
    if candidates.is_sorted:
        return candidates.replace(logits=nucleus_mask_sorted(candidates.logits, p))
    logits = candidates.logits
    width = min(TOP_P_FAST_CANDIDATES, logits.shape[1])
    best = jax.lax.top_k(logits, width)[0]
    total = jax.nn.logsumexp(logits, axis=-1)
    # the width-th best token lies inside the nucleus only if the tokens before it hold < top_p
    mass_before_last = jnp.exp(jax.nn.logsumexp(best[:, :-1], axis=-1) - total) if width > 1 else jnp.zeros_like(total)
    fits = jnp.all(mass_before_last >= p) | (width == logits.shape[1])

    def fast(_):
        probs = jnp.exp(best - total[:, None])  # mass under the full distribution, as a sort would see it
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = (mass_before < p) | (jnp.arange(width) == 0)[None, :]
        threshold = jnp.min(jnp.where(keep, best, jnp.inf), axis=-1)
        return jnp.where(logits >= threshold[:, None], logits, NEG_INF)

    def slow(_):
        threshold = nucleus_threshold_bisect(logits, p)
        return jnp.where(logits >= threshold[:, None], logits, NEG_INF)

    return candidates.replace(logits=jax.lax.cond(fits, fast, slow, None))
