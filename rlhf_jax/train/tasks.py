"""Which trainer runs a config: ``algorithm.type`` names it.

``rl`` is the online RL loop (its estimator is ``algorithm.adv_estimator``);
other training kinds register their trainer class here by dotted path (and their name in
``rlhf_jax.config.names.TRAINER_TYPES``), so
importing this module stays cheap and a stage list can name any of them. A config
with ``stages`` runs them in order (train/stages.py, which builds each stage's trainer from here).
Every trainer offers the same calls to ``main``: ``plan_memory()``, ``fit()``,
``out_of_memory(error)`` and ``close()``, and is built as ``cls(cfg, lock_dir=True)``;
the run loop drives it through the ``fit_loop.Trainer`` protocol.
"""

from __future__ import annotations

import importlib

from rlhf_jax.config.names import TRAINER_TYPES, check_type

TRAINERS: dict[str, str] = {
    "rl": "rlhf_jax.train.trainer:Trainer",
    "dpo": "rlhf_jax.train.dpo:DPOTrainer",
    "sft": "rlhf_jax.train.sft:SFTTrainer",
}
if tuple(TRAINERS) != TRAINER_TYPES:  # the names algorithm.type accepts
    raise RuntimeError(f"rlhf_jax.config.names.TRAINER_TYPES {TRAINER_TYPES} != the trainers {tuple(TRAINERS)}")


def trainer_class(name: str) -> type:
    """The trainer class registered under ``name``."""
    check_type(name)
    module, attr = TRAINERS[name].split(":")
    return getattr(importlib.import_module(module), attr)
