"""Optimizer and learning-rate schedules (the ``optim`` sections of actor and critic).

As in verl, the schedule advances once per *training step* (not per mini-batch
update): with ``updates_per_step`` optimizer updates in a step, the schedule is
evaluated at ``update_count // updates_per_step``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax.numpy as jnp
import optax

WARMUP_STYLES = ("constant", "cosine", "linear")


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
    """lr(step) for a training step: linear warmup from 0, then constant, cosine or linear decay to min_lr_ratio x lr."""
    if style not in WARMUP_STYLES:
        raise ValueError(f"optim.warmup_style must be one of {WARMUP_STYLES}, got {style!r}")
    total = max(int(total_steps), 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.where(warmup > 0, jnp.minimum(1.0, step / max(warmup, 1)), 1.0)
        progress = jnp.clip((step - warmup) / max(total - warmup, 1), 0.0, 1.0)
        if style == "constant":
            decay = 1.0
        elif style == "cosine":
            cos = 0.5 * (1.0 + jnp.cos(math.pi * 2.0 * num_cycles * progress))
            decay = min_lr_ratio + (1.0 - min_lr_ratio) * cos
        else:
            decay = min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
        return lr * jnp.where(step < warmup, warm, decay)

    return schedule


def make_optimizer(optim_cfg: Any, grad_clip: float, total_steps: int, updates_per_step: int):
    """(optax transformation, lr-of-training-step function) from an ``optim`` config section."""
    get = lambda k, d=None: optim_cfg.get(k, d) if hasattr(optim_cfg, "get") else getattr(optim_cfg, k, d)  # noqa: E731
    schedule = step_schedule(
        float(get("lr")),
        total_steps,
        warmup=warmup_steps(get("lr_warmup_steps", -1), get("lr_warmup_steps_ratio", 0.0), total_steps),
        style=get("warmup_style", "constant") or "constant",
        min_lr_ratio=float(get("min_lr_ratio", 0.0) or 0.0),
        num_cycles=float(get("num_cycles", 0.5)),
    )
    per_update = lambda count: schedule(count // max(updates_per_step, 1))  # noqa: E731
    betas = tuple(get("betas", (0.9, 0.999)) or (0.9, 0.999))
    update = optimizer_transform(str(get("optimizer", "AdamW") or "AdamW"), per_update, betas,
                                 float(get("eps", 1e-8) or 1e-8), float(get("weight_decay", 0.01)))
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip and grad_clip > 0 else []
    return optax.chain(*parts, update), schedule


def optimizer_transform(name: str, lr, betas: tuple, eps: float, weight_decay: float) -> optax.GradientTransformation:
    """``optim.optimizer`` (case-insensitive) as PyTorch defines it: AdamW's decay is decoupled; Adam's and SGD's
    (no momentum) is L2 added to the gradient; Lion (sign of the interpolated momentum, decoupled decay) uses
    ``betas`` as its (beta1, beta2)."""
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
    raise ValueError(f"optim.optimizer={name!r}: choose one of AdamW, Adam, SGD, Lion")
