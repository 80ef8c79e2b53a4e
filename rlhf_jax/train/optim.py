"""Optimizer and learning-rate schedules (the ``optim`` sections of actor and critic).

``optim.optimizer`` names the update rule as PyTorch (or transformers, for Adafactor) defines it;
``optim.override_optimizer_config`` holds the further keyword arguments of that class (verl's key), checked
by :func:`rlhf_jax.config.optimizers.optimizer_settings`: the ones with a meaning here are applied, the rest are refused by name.

As in verl, the schedule advances once per *training step* (not per mini-batch
update): with ``updates_per_step`` optimizer updates in a step, the schedule is
evaluated at ``update_count // updates_per_step``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rlhf_jax.config.names import OPTIMIZER_NAMES, WARMUP_STYLES
from rlhf_jax.config.optimizers import optimizer_settings

WSD_STABLE_RATIO = 0.9  # verl's get_wsd_schedule_with_warmup default (its SFT trainer passes no other)


def warmup_steps(lr_warmup_steps: int, lr_warmup_steps_ratio: float, total_steps: int) -> int:
    """verl: a non-negative lr_warmup_steps wins; otherwise ratio x total steps."""
    if lr_warmup_steps is not None and lr_warmup_steps >= 0:
        return int(lr_warmup_steps)
    return int(float(lr_warmup_steps_ratio) * total_steps)


def step_schedule(
    lr: float,
    total_steps: int,
    *,
    warmup: int = 0,
    style: str = "constant",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> Callable[[Any], Any]:
    """lr(step) for a training step: linear warmup from 0, then constant, cosine or linear decay to min_lr_ratio x lr,
    or wsd: constant for WSD_STABLE_RATIO of the steps after warmup, then a cosine decay over the rest."""
    if style not in WARMUP_STYLES:
        raise ValueError(f"optim.warmup_style must be one of {WARMUP_STYLES}, got {style!r}")
    total = max(int(total_steps), 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.where(warmup > 0, jnp.minimum(1.0, step / max(warmup, 1)), 1.0)
        progress = jnp.clip((step - warmup) / max(total - warmup, 1), 0.0, 1.0)
        if style == "wsd":
            stable = int(max(total - warmup, 0) * WSD_STABLE_RATIO)
            progress = jnp.clip((step - warmup - stable) / max(total - warmup - stable, 1), 0.0, 1.0)
        if style == "constant":
            decay = 1.0
        elif style in ("cosine", "wsd"):
            cos = 0.5 * (1.0 + jnp.cos(math.pi * 2.0 * num_cycles * progress))
            decay = min_lr_ratio + (1.0 - min_lr_ratio) * cos
        else:
            decay = min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
        return lr * jnp.where(step < warmup, warm, decay)

    return schedule


_MADE: dict[tuple, tuple] = {}  # settings -> (transformation, schedule): equal settings, the same objects


def make_optimizer(optim_cfg: Any, grad_clip: float, total_steps: int, updates_per_step: int):
    """(optax transformation, lr-of-training-step function) from the ``optim`` section of a finalized config.

    Equal settings return the same objects: a training role's programs are shared by value with any other role
    built alike (runtime/programs.py), and the transformation, a tuple of functions, is the one part of that value
    that compares by identity."""
    o = optim_cfg
    further = optimizer_settings(o.optimizer, o.override_optimizer_config)
    settings = (o.optimizer, float(o.lr), o.lr_warmup_steps, o.lr_warmup_steps_ratio, o.warmup_style,
                float(o.min_lr_ratio), float(o.num_cycles), tuple(o.betas), float(o.eps), float(o.weight_decay),
                repr(sorted(further.items())), grad_clip, total_steps, updates_per_step)
    if settings not in _MADE:
        _MADE[settings] = _make_optimizer(o, further, grad_clip, total_steps, updates_per_step)
    return _MADE[settings]


def _make_optimizer(o: Any, further: dict, grad_clip: float, total_steps: int, updates_per_step: int):
    schedule = step_schedule(
        float(o.lr),
        total_steps,
        warmup=warmup_steps(o.lr_warmup_steps, o.lr_warmup_steps_ratio, total_steps),
        style=o.warmup_style,
        min_lr_ratio=float(o.min_lr_ratio),
        num_cycles=float(o.num_cycles),
    )
    per_update = lambda count: schedule(count // max(updates_per_step, 1))  # noqa: E731
    update = optimizer_transform(o.optimizer, per_update, tuple(o.betas), float(o.eps), float(o.weight_decay), further)
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip and grad_clip > 0 else []
    return optax.chain(*parts, update), schedule


class _AdafactorStepState(NamedTuple):
    count: jax.Array
    exp_avg: Any  # first moment per parameter, or () without beta1


def _adafactor_step(lr, scale_parameter: bool, min_scale: float, beta1, weight_decay: float):
    """transformers' Adafactor after its RMS clipping: the step size is lr x max(min_scale, RMS(param)) (or lr),
    an optional first moment (EMA, no bias correction) of the scaled update, and weight decay
    ``weight_decay x step size x param`` taken from the parameter before the update."""
    def init(params):
        exp_avg = jax.tree.map(jnp.zeros_like, params) if beta1 is not None else ()
        return _AdafactorStepState(jnp.zeros([], jnp.int32), exp_avg)

    def update(updates, state, params):
        rate = lr(state.count)

        def size(p):
            return rate * jnp.maximum(jnp.sqrt(jnp.mean(jnp.square(p))), min_scale) if scale_parameter else rate

        steps = jax.tree.map(lambda u, p: size(p) * u, updates, params)
        exp_avg = state.exp_avg
        if beta1 is not None:
            exp_avg = jax.tree.map(lambda m, u: beta1 * m + (1 - beta1) * u, exp_avg, steps)
            steps = exp_avg
        out = jax.tree.map(lambda u, p: -u - weight_decay * size(p) * p, steps, params)
        return out, _AdafactorStepState(optax.safe_increment(state.count), exp_avg)

    return optax.GradientTransformation(init, update)


def adafactor(lr, weight_decay: float, settings: dict) -> optax.GradientTransformation:
    """transformers' Adafactor (relative_step=False) from optax's pieces: factored second moments with
    decay 1 - t^decay_rate over the two largest dimensions of every parameter with two or more (transformers
    factors the last two of its 2-D weights: the same for matrices), then RMS clipping and the step."""
    eps1, eps2 = (float(e) for e in settings["eps"])
    return optax.chain(
        optax.scale_by_factored_rms(decay_rate=-float(settings["decay_rate"]), min_dim_size_to_factor=1,
                                    epsilon=eps1),
        optax.clip_by_block_rms(float(settings["clip_threshold"])),
        _adafactor_step(lr, bool(settings["scale_parameter"]), eps2,
                        None if settings["beta1"] is None else float(settings["beta1"]), weight_decay),
    )


def optimizer_transform(name: str, lr, betas: tuple, eps: float, weight_decay: float,
                        settings: dict | None = None) -> optax.GradientTransformation:
    """``optim.optimizer`` (case-insensitive) as PyTorch defines it: AdamW's decay is decoupled; Adam's and SGD's
    (no momentum) is L2 added to the gradient; Lion (sign of the interpolated momentum, decoupled decay) uses
    ``betas`` as its (beta1, beta2); Adafactor is transformers' with ``settings`` (:func:`optimizer_settings`)."""
    key = name.lower()
    b1, b2 = float(betas[0]), float(betas[1])
    if key == "adamw":
        return optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if key == "adam":
        return optax.chain(optax.add_decayed_weights(weight_decay), optax.adam(lr, b1=b1, b2=b2, eps=eps))
    if key == "sgd":
        return optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(lr))
    if key == "lion":
        return optax.lion(lr, b1=b1, b2=b2, weight_decay=weight_decay)
    if key == "adafactor":
        return adafactor(lr, weight_decay, settings if settings is not None else optimizer_settings(name, None))
    raise ValueError(f"optim.optimizer={name!r}: choose one of {', '.join(OPTIMIZER_NAMES.values())}")
