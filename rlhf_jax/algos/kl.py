"""KL estimators, in-reward KL penalty, KL loss and the KL coefficient controllers.

Estimators (algorithm.kl_penalty, actor.kl_loss_type): kl/k1, abs, mse/k2,
low_var_kl/k3 (clamped at +-20 then +-10), full (over vocabulary rows). A "+"
suffix (e.g. ``k3+``) keeps the named estimator's value but takes the gradient
of k2: 0.5 d^2 - sg(0.5 d^2) + sg(value).
Controllers are small checkpointable dicts of arrays with a pure update.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .aggregation import agg_loss, masked_mean
from .entropy import map_sequence_chunks
from .registry import KL_ESTIMATORS, register_kl_estimator

Array = jnp.ndarray


@register_kl_estimator("kl")
@register_kl_estimator("k1")
def kl_k1(logprob: Array, ref_logprob: Array) -> Array:
    """log pi - log ref."""
    return logprob - ref_logprob


@register_kl_estimator("abs")
def kl_abs(logprob: Array, ref_logprob: Array) -> Array:
    """|log pi - log ref|."""
    return jnp.abs(logprob - ref_logprob)


@register_kl_estimator("mse")
@register_kl_estimator("k2")
def kl_k2(logprob: Array, ref_logprob: Array) -> Array:
    """0.5 (log pi - log ref)^2."""
    return 0.5 * jnp.square(logprob - ref_logprob)


@register_kl_estimator("low_var_kl")
@register_kl_estimator("k3")
def kl_k3(logprob: Array, ref_logprob: Array) -> Array:
    """x = clamp(ref - logp, -20, 20); clamp(exp(x) - x - 1, -10, 10)."""
    x = jnp.clip(ref_logprob - logprob, -20.0, 20.0)
    return jnp.clip(jnp.exp(x) - x - 1.0, -10.0, 10.0)


def full_kl_from_logits(
    logits: Array, ref_logits: Array, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Array:
    """KL(pi || ref) = sum_v p (log p - log q) per position from (batch, length, vocab) rows.

    Rows may be logits or log-probs (log_softmax is applied either way); computed in
    sequence chunks so no whole float32 (batch, length, vocab) tensor is formed.
    """

    def chunk(z: Array, zr: Array) -> Array:
        lp = jax.nn.log_softmax(z.astype(jnp.float32) / temperature, axis=-1)
        lq = jax.nn.log_softmax(zr.astype(jnp.float32) / temperature, axis=-1)
        return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)

    return map_sequence_chunks(chunk, logits, ref_logits, chunk_size=chunk_size)


def check_kl_kind(kind: str) -> None:
    """Validate a KL estimator name (with optional '+' suffix) without computing."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base == "full":
        if kind.endswith("+"):
            raise ValueError("KL estimator 'full+' is not defined: 'full' already has the exact gradient")
        return
    KL_ESTIMATORS.check(base)


def kl_penalty(logprob: Array, ref_logprob: Array, kind: str, *, chunk_size: int | None = None) -> Array:
    """Per-token KL estimate of ``kind`` (static string), shape (batch, length).

    For ``full``, pass (batch, length, vocab) logits or log-prob rows of the policy and
    the reference; for the others, (batch, length) log-probs of the sampled tokens.
    """
    check_kl_kind(kind)
    if kind == "full":
        if logprob.ndim != 3 or ref_logprob.ndim != 3:
            raise ValueError("kl_penalty 'full' needs (batch, length, vocab) logit rows for policy and reference")
        return full_kl_from_logits(logprob, ref_logprob, chunk_size=chunk_size)
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    value = KL_ESTIMATORS.get(base)(logprob, ref_logprob)
    if not straight_through or base in ("mse", "k2"):
        return value
    k2 = 0.5 * jnp.square(logprob - ref_logprob)
    return k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(value)


def apply_kl_in_reward(
    token_level_scores: Array,
    old_log_prob: Array,
    ref_log_prob: Array,
    response_mask: Array,
    kl_coef: Array | float,
    kind: str = "kl",
) -> tuple[Array, Array]:
    """In-reward KL: rewards = scores - beta * kl * M; also returns current_kl (batch mean of per-sequence masked means)."""
    kld = kl_penalty(old_log_prob, ref_log_prob, kind) * response_mask
    rewards = token_level_scores - kl_coef * kld
    current_kl = jnp.mean(masked_mean(kld, response_mask, axis=-1))
    return rewards, current_kl


def kl_loss(
    log_prob: Array,
    ref_log_prob: Array,
    response_mask: Array,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    *,
    denominator: Array | float | None = None,
    norm_constant: float | None = None,
) -> Array:
    """Aggregated KL loss (actor.use_kl_loss); multiply by kl_loss_coef in the caller."""
    kld = kl_penalty(log_prob, ref_log_prob, kind)
    return agg_loss(kld, response_mask, loss_agg_mode, denominator=denominator, norm_constant=norm_constant)


# ----------------------------------------------------------------------------- controllers
KL_CTRL_TYPES = ("fixed", "adaptive")


def init_kl_controller(
    kl_coef: float = 0.001, type: str = "fixed", target_kl: float = 0.1, horizon: float = 10000
) -> dict[str, Array]:
    """Controller state (algorithm.kl_ctrl): value (beta), target_kl, horizon, adaptive flag; all arrays."""
    if type not in KL_CTRL_TYPES:
        raise ValueError(f"unknown algorithm.kl_ctrl.type {type!r}; choose one of: {', '.join(KL_CTRL_TYPES)}")
    if type == "adaptive" and not horizon > 0:
        raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
    return {
        "value": jnp.asarray(kl_coef, jnp.float32),
        "target_kl": jnp.asarray(target_kl, jnp.float32),
        "horizon": jnp.asarray(horizon, jnp.float32),
        "adaptive": jnp.asarray(type == "adaptive"),
    }


def update_kl_controller(state: dict[str, Array], current_kl: Array | float, n_steps: Array | float) -> dict[str, Any]:
    """Adaptive: e = clip(kl / target - 1, -0.2, 0.2); beta <- beta (1 + e n_steps / horizon). Fixed: unchanged."""
    err = jnp.clip(jnp.asarray(current_kl, jnp.float32) / state["target_kl"] - 1.0, -0.2, 0.2)
    mult = 1.0 + err * jnp.asarray(n_steps, jnp.float32) / state["horizon"]
    value = jnp.where(state["adaptive"], state["value"] * mult, state["value"])
    return {**state, "value": value}
