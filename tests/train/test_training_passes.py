"""Trainer-level properties of the training passes: honest stage timers, bounded compiles over steps of
varying lengths, packed == padded GRPO step, and bfloat16 compute against float32."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config

STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
VARYING = {"data.max_response_length": 12}


@pytest.fixture(scope="module")
def early_stopping_model(tmp_path_factory) -> str:
    """The tiny default model with 40 of its 264 tokens declared EOS in generation_config.json, so that its
    random-policy responses end after 1..12 tokens and their lengths vary from step to step."""
    from rlhf_jax.tools.tiny import ensure

    out = str(tmp_path_factory.mktemp("early_stop") / "tiny")
    shutil.copytree(ensure(), out)
    path = os.path.join(out, "generation_config.json")
    gen = json.load(open(path))
    gen["eos_token_id"] = [gen["eos_token_id"]] + list(range(40, 79))
    json.dump(gen, open(path, "w"))
    return out


def _steps(trainer: Trainer, count: int) -> list[dict]:
    out = []
    for step in range(count):
        out.append(trainer.train_on(next(trainer.loader), step))
    return out


def test_stage_timers_wait_for_their_outputs_and_add_up_to_the_step(tmp_path):
    trainer = Trainer(make_config(str(tmp_path), "grpo", **VARYING))  # grpo: KL loss, so a reference pass runs
    try:
        metrics = _steps(trainer, 3)
    finally:
        trainer.close()
    for m in metrics[1:]:  # after the first step's compilations
        assert m["timing_s/ref"] > 0
        staged = sum(m.get(f"timing_s/{k}", 0.0) for k in STAGES)
        assert staged == pytest.approx(m["timing_s/step"], rel=0.10), {k: m.get(f"timing_s/{k}") for k in STAGES}


@pytest.mark.parametrize("packed", [True, False])
def test_compiled_programs_stay_bounded_over_ten_steps_of_varying_lengths(tmp_path, early_stopping_model, packed):
    """Packed: per pass one micro-batch shape and at most 8 logit-list sizes (``logit_list_size``), plus the
    zero-grad and apply programs of the update, whatever the lengths. Padded: one per (prompt bucket, response
    bucket) of the trimmed batch; responses here fit 2 buckets (<= 16)."""
    cfg = make_config(str(tmp_path), "grpo", **{"data.max_response_length": 40,
                                                "actor_rollout_ref.model.use_remove_padding": packed,
                                                "trainer.total_training_steps": 10,
                                                "actor_rollout_ref.model.path": early_stopping_model})
    trainer = Trainer(cfg)
    try:
        metrics = _steps(trainer, 10)
        lengths = {m["response_length/max"] for m in metrics}
        assert len(lengths) > 1, lengths  # the lengths did vary
        actor, ref = trainer.actor.num_compiled(), trainer.ref.num_compiled()
        programs = [key for role in (trainer.actor, trainer.ref) for key in role._compiled]
    finally:
        trainer.close()
    if packed:  # actor: old log-probs and the update's micro-batch gradient (+ zero grads, apply); ref: log-probs
        for kind in ("packed_logp", "packed_grads"):
            for role_programs in ([k for k in programs[:actor]], [k for k in programs[actor:]]):
                keys = [k for k in role_programs if k[0] == kind]
                micro_shape_at = 1 if kind == "packed_logp" else 2
                assert len({k[micro_shape_at] for k in keys}) <= 1 and len(keys) <= 8, keys
        assert actor <= 2 * 8 + 2 and ref <= 8
        print(f"compiled programs over 10 steps: actor {actor}, ref {ref}")
    else:  # prompts: one bucket (the loader pads them to 16); responses trim to widths 16, 32 or 40
        assert actor <= 2 * 3 and ref <= 3


def _one_step_params(tmp_path, name: str, **overrides):
    cfg = make_config(str(tmp_path / name), "grpo", **VARYING, **overrides)
    trainer = Trainer(cfg)
    try:
        metrics = _steps(trainer, 1)[0]
        params = jax.tree.map(np.asarray, trainer.actor.params)
    finally:
        trainer.close()
    return metrics, params


def test_a_full_grpo_step_packed_equals_padded(tmp_path):
    # Adam's first step moves each weight by lr * g / (|g| + eps): with the default eps (1e-8) a weight whose
    # gradient is ~1e-8 turns float32 rounding of g into a different step. eps = 1e-4 keeps the step a smooth
    # function of the gradient, so equal gradients (to float32 rounding) give equal parameters.
    common = {"actor_rollout_ref.actor.optim.eps": 1e-4}
    m_pad, p_pad = _one_step_params(tmp_path, "padded", **common, **{"actor_rollout_ref.model.use_remove_padding": False})
    m_pack, p_pack = _one_step_params(tmp_path, "packed", **common, **{"actor_rollout_ref.model.use_remove_padding": True})
    assert m_pack["response_length/mean"] == m_pad["response_length/mean"]  # the same samples
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert m_pack[k] == pytest.approx(m_pad[k], rel=1e-5, abs=1e-7), k
    for (path, a), b in zip(jax.tree.leaves_with_path(p_pad), jax.tree.leaves(p_pack)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6, err_msg=jax.tree_util.keystr(path))
