"""One decision says which passes an RL step runs and which arrays its updates read (train/passes.py
``step_passes``); the memory plan compiles from ``TrainBatch.abstract`` with the same fields, so the plan and the
step cannot disagree. A trainer with only the rollout correction asking for the old log-probs plans that pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.algos.rollout_correction import correction_from_config
from rlhf_jax.config.validate import finalize
from rlhf_jax.parallel import make_mesh
from rlhf_jax.train.batching import mini_batches
from rlhf_jax.parallel.hosts import to_global
from rlhf_jax.train.passes import pass_batch, step_passes
from rlhf_jax.types import TrainBatch, shape_key
from tests.train.helpers import make_config

CORR = "algorithm.rollout_correction."


def _passes(tmp_path, recipe="grpo", one_update=False, **overrides):
    """(finalized config, its passes); ``one_update``: one mini-batch, one epoch (the old log-probs are the
    sampler's unless something else needs them)."""
    cfg = make_config(str(tmp_path), recipe, **overrides)
    if one_update:
        cfg.actor_rollout_ref.actor.ppo_mini_batch_size = cfg.data.train_batch_size
        cfg.actor_rollout_ref.actor.ppo_epochs = 1
    cfg = finalize(cfg, num_devices=jax.device_count(), check_paths=False)
    correction = correction_from_config(cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.actor.tis_imp_ratio_cap)
    return cfg, step_passes(cfg, correction, use_kl_loss=bool(cfg.actor_rollout_ref.actor.use_kl_loss))


def test_the_rollout_correction_alone_runs_the_old_log_prob_pass(tmp_path):
    cfg, plain = _passes(tmp_path, one_update=True)
    assert not cfg.derived.recompute_old_log_prob and not cfg.algorithm.use_kl_in_reward
    assert not plain.runs("old_log_prob") and "rollout_is_weights" not in plain.fields("update_actor")
    _, rejecting = _passes(tmp_path, one_update=True,
                           **{CORR + "rollout_rs": "token", CORR + "rollout_rs_threshold": 2.0})
    assert rejecting.runs("old_log_prob") and "rollout_is_weights" not in rejecting.fields("update_actor")
    _, weighting = _passes(tmp_path, one_update=True, **{CORR + "rollout_is": "token"})
    assert weighting.runs("old_log_prob") and "rollout_is_weights" in weighting.fields("update_actor")


def test_critic_and_shared_value_head_passes(tmp_path):
    _, separate = _passes(tmp_path, "ppo")
    assert separate.values == "critic" and separate.runs("update_critic")
    assert separate.fields("update_critic") == ("values", "returns")
    assert "values" not in separate.fields("update_actor")
    _, shared = _passes(tmp_path, "ppo", **{"critic.shared_trunk": True, "critic.optim.lr": 1e-5})
    assert shared.values == "actor" and shared.runs("values") and not shared.runs("update_critic")
    assert {"values", "returns"} <= set(shared.fields("update_actor"))


def test_the_planned_batch_has_the_fields_the_step_gives_the_update(tmp_path):
    cfg, passes = _passes(tmp_path, **{CORR + "rollout_is": "token"})
    R, P = cfg.actor_rollout_ref.rollout.response_length, cfg.data.max_prompt_length
    rows = cfg.derived.rollout_batch_size
    rng = np.random.default_rng(0)
    full = TrainBatch(**{f: jnp.asarray(rng.normal(size=(rows, R)), jnp.float32) for f in (
        "old_log_probs", "ref_log_probs", "advantages", "returns", "rollout_is_weights")},
        input_ids=jnp.zeros((rows, P + R), jnp.int32), attention_mask=jnp.ones((rows, P + R), jnp.int32),
        responses=jnp.zeros((rows, R), jnp.int32), response_mask=jnp.ones((rows, R), jnp.int32))
    mesh = make_mesh(2, 2, 2)
    full = jax.tree.map(lambda x: to_global(mesh, np.asarray(x)), full)
    step_mb = mini_batches(mesh, full.only(passes.fields("update_actor")), cfg.derived.actor_num_mini_batches)[0]
    for packed in (False, True):
        planned = pass_batch(cfg, passes, "update_actor", packed)
        given = step_mb.grid() if packed else step_mb
        assert shape_key(planned) == shape_key(given), (packed, shape_key(planned), shape_key(given))


def test_forward_kl_topk_passes_the_teachers_top_k_arrays_to_the_update(tmp_path):
    """The teacher's pass returns (N, R, k) top-k ids and log-probs in place of ref_log_probs; the planned update
    batch has them with the shapes and dtypes the step gives it."""
    settings = {"distillation.enabled": True, "distillation.teacher_models.teacher_model.model_path": str(tmp_path),
                "distillation.distillation_loss.loss_mode": "forward_kl_topk", "distillation.distillation_loss.topk": 5,
                "actor_rollout_ref.actor.use_kl_loss": False}
    cfg, passes = _passes(tmp_path, **settings)
    assert passes.runs("ref") and passes.teacher_topk == 5
    fields = passes.fields("update_actor")
    assert {"teacher_topk_ids", "teacher_topk_log_probs"} <= set(fields) and "ref_log_probs" not in fields
    R, rows = cfg.actor_rollout_ref.rollout.response_length, cfg.derived.actor_mini_batch_size
    planned = pass_batch(cfg, passes, "update_actor", packed=True)
    assert planned.teacher_topk_ids.shape == (rows, R, 5) and planned.teacher_topk_ids.dtype == jnp.int32
    assert planned.teacher_topk_log_probs.shape == (rows, R, 5) and planned.teacher_topk_log_probs.dtype == jnp.float32
    _, estimator = _passes(tmp_path, **{**settings, "distillation.distillation_loss.loss_mode": "k3"})
    assert estimator.teacher_topk == 0 and "ref_log_probs" in estimator.fields("update_actor")
