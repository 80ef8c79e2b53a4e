"""bfloat16 on the accelerator path: bf16 compute over float32 master weights and optimizer state, and bf16 sampling.

One GRPO step (the tiny default run: 4 prompts x 2 samples) in four precisions from the same seed and data:

- ``fp32``: everything float32 (the reference);
- ``bf16_train``: ``model.compute_dtype=bfloat16`` (forward and backward passes in bf16, parameters, gradients and
  Adam moments float32) with ``rollout.dtype=float32``, so it samples exactly the reference's responses and its
  update sees the same inputs;
- ``bf16_sampler``: float32 training, sampling in bf16 from a bf16 copy of the weights (``rollout.dtype`` and
  ``rollout.weight_dtype``);
- ``bf16``: all of it in bf16 (training compute, sampler compute and sampler weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, read_metrics

BF16 = "bfloat16"
RUNS = {
    "fp32": {},
    "bf16_train": {"actor_rollout_ref.model.compute_dtype": BF16, "actor_rollout_ref.rollout.dtype": "float32"},
    "bf16_sampler": {"actor_rollout_ref.rollout.dtype": BF16, "actor_rollout_ref.rollout.weight_dtype": BF16},
    "bf16": {"actor_rollout_ref.model.compute_dtype": BF16, "actor_rollout_ref.rollout.weight_dtype": BF16},
}


def _run(tmp_path_factory, name: str) -> dict:
    out = str(tmp_path_factory.mktemp(name))
    trainer = Trainer(make_config(out, **RUNS[name], **{"trainer.total_training_steps": 1}))
    try:
        trainer.fit()
        actor = trainer.actor
        sampler_weights = trainer.rollouts.weights()
        programs = [p.as_text() for p in actor._compiled.values() if hasattr(p, "as_text")]
        return {
            "metrics": read_metrics(out)[-1],
            "param_dtypes": {str(x.dtype) for x in jax.tree.leaves(actor.params)},
            "moment_dtypes": {str(x.dtype) for x in jax.tree.leaves(actor.opt_state) if getattr(x, "ndim", 0) > 0},
            "sampler_weight_dtypes": {str(x.dtype) for x in jax.tree.leaves(sampler_weights)
                                      if jnp.issubdtype(x.dtype, jnp.floating)},
            "update_has_bf16_dots": any("bf16[" in p and " dot(" in p for p in programs),
            "sampler_has_bf16_cache": any("bf16[" in p.as_text() for p in trainer.rollouts.sampler._compiled.values()),
            "responses": read_metrics(out)[-1]["response_length/mean"],
        }
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return {name: _run(tmp_path_factory, name) for name in RUNS}


def test_bf16_compute_keeps_float32_master_weights_and_moments(runs):
    for name in RUNS:
        r = runs[name]
        assert r["param_dtypes"] == {"float32"} and r["moment_dtypes"] == {"float32"}, name
    assert runs["bf16_train"]["update_has_bf16_dots"] and runs["bf16"]["update_has_bf16_dots"]
    assert not runs["fp32"]["update_has_bf16_dots"] and not runs["bf16_sampler"]["update_has_bf16_dots"]
    # the sampler reads a bf16 copy only where rollout.weight_dtype asks for one; the actor keeps float32
    assert runs["bf16_sampler"]["sampler_weight_dtypes"] == runs["bf16"]["sampler_weight_dtypes"] == {BF16}
    assert runs["fp32"]["sampler_weight_dtypes"] == runs["bf16_train"]["sampler_weight_dtypes"] == {"float32"}
    assert runs["bf16_sampler"]["sampler_has_bf16_cache"] and not runs["fp32"]["sampler_has_bf16_cache"]


# bfloat16 keeps 8 significant bits: one rounding is off by at most u = 2^-8 relative (half an ulp is 2^-9; u allows a
# couple of roundings in a row). The tolerances below are small multiples of u.
U = 2.0**-8


def test_bf16_grpo_step_matches_float32(runs):
    ref, bf = runs["fp32"]["metrics"], runs["bf16_train"]["metrics"]
    # float32 sampling in both: the same responses and scores, so the update's inputs are the same
    for key in ("critic/score/mean", "response_length/mean", "critic/advantages/mean", "critic/advantages/max"):
        assert bf[key] == ref[key], key
    # The gradient is a float32 sum of many bf16 products: its norm is off by a few roundings at most (measured on
    # the tiny model: 1.8585 vs 1.8552, 1.8e-3 relative).
    assert bf["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=4 * U)
    # The entropy sums p log p over the vocabulary in float32 from bf16 logits (measured: 1.5e-6 relative).
    assert bf["actor/entropy"] == pytest.approx(ref["actor/entropy"], rel=U)
    # The GRPO loss -mean(A * ratio) cancels (group advantages sum to 0, here +-1/sqrt(2)), so its error is measured
    # against the size of its terms: |A| < 1 times the ratio's error, a few bf16 roundings of log-probs recomputed by
    # two programs (measured: 0.006075 vs 0.005983, a difference of 9.3e-5).
    assert abs(bf["actor/pg_loss"] - ref["actor/pg_loss"]) < U


def test_rollout_training_mismatch_in_both_precisions(runs):
    """verl's mismatch metrics between the sampler's log-probs and the training pass's recomputation.

    The tiny random model is near uniform (perplexity ~257 over its vocabulary), so each sampled token's
    probability is ~1/257 and differences in probability are ~1/257 of the relative ones."""
    fp32 = runs["fp32"]["metrics"]
    # float32 sampler and float32 training pass: the same numbers up to float32 rounding
    assert fp32["training/rollout_probs_diff_mean"] < 1e-8  # measured 4.8e-10
    assert fp32["rollout_corr/k3_kl"] < 1e-10 and fp32["rollout_corr/log_ppl_abs_diff"] < 1e-6
    assert fp32["training/rollout_actor_probs_pearson_corr"] > 1 - 1e-6
    for name in ("bf16_train", "bf16_sampler", "bf16"):  # one side or both in bf16
        m = runs[name]["metrics"]
        diff, ppl = m["training/rollout_probs_diff_mean"], m["rollout_corr/rollout_ppl"]
        # far above float32's, below a few bf16 roundings of each probability (measured 2.6e-6 .. 4.1e-6, i.e.
        # 7e-4 .. 1.1e-3 relative to the mean probability)
        assert diff > 100 * fp32["training/rollout_probs_diff_mean"] and diff > 1e-7, (name, diff)
        assert diff * ppl < 4 * U, (name, diff)
        # k3 = E[exp(d) - d - 1] ~ E[d^2] / 2 for log-prob differences d of a few roundings (measured 5e-7 .. 9e-7)
        assert 1e-8 < m["rollout_corr/k3_kl"] < (4 * U) ** 2 / 2, (name, m["rollout_corr/k3_kl"])
        assert 1e-5 < m["rollout_corr/log_ppl_abs_diff"] < 4 * U, name
        assert m["training/rollout_actor_probs_pearson_corr"] > 1 - 1e-3, name


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_model_dtype_is_the_parameter_and_optimizer_state_dtype(param_dtype):
    """``model.dtype`` as the trainer applies it (``setup.DTYPES`` -> parameters; the optimizer's moments follow them),
    with ``model.compute_dtype=bfloat16``: gradients and moments in the parameters' dtype, activations in bf16."""
    from rlhf_jax.models import from_hf_dict, init_model
    from rlhf_jax.parallel import single_device_mesh
    from rlhf_jax.train.engine import Role
    from rlhf_jax.config import base_config
    from rlhf_jax.train.optim import make_optimizer
    from rlhf_jax.train.setup import DTYPES
    from rlhf_jax.train import losses
    from rlhf_jax.types import TrainBatch

    from tests.train.helpers import loss_specs

    hf = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    mesh = single_device_mesh()
    model = init_model(from_hf_dict(hf, dtype=DTYPES[BF16], param_dtype=DTYPES[param_dtype]), mesh=mesh)
    optim = base_config().actor_rollout_ref.actor.optim
    optim.lr = 1e-3
    tx, _ = make_optimizer(optim, 1.0, 10, 1)
    role = Role(model, mesh, tx)
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 64, (2, 12)).astype(np.int32), "attention_mask": np.ones((2, 12), np.int32),
             "responses": rng.integers(0, 64, (2, 4)).astype(np.int32), "response_mask": np.ones((2, 4), np.int32),
             "old_log_probs": np.full((2, 4), -4.0, np.float32), "advantages": rng.standard_normal((2, 4)).astype(np.float32)}
    before = jax.tree.map(np.asarray, role.params)
    mb = TrainBatch(**{k: jnp.asarray(v) for k, v in batch.items()})
    metrics = role.update(losses.actor(loss_specs()[0]), mb, n_micro=1, rng=jax.random.key(0))
    assert np.isfinite(float(metrics["actor/grad_norm"])) and float(metrics["actor/grad_norm"]) > 0
    moments = [x for x in jax.tree.leaves(role.opt_state) if getattr(x, "ndim", 0) > 0]
    assert moments and {str(x.dtype) for x in moments} == {param_dtype}
    assert {str(x.dtype) for x in jax.tree.leaves(role.params)} == {param_dtype}
    assert any((np.asarray(a) != b).any() for a, b in zip(jax.tree.leaves(role.params), jax.tree.leaves(before)))
    (program,) = [p for k, p in role._compiled.items() if k[0] == "actor"]
    text = program.lower(role.params, role.frozen, role.opt_state, mb, jax.random.key(0)).as_text()
    assert "bf16" in text  # the forward and backward passes compute in bf16 either way


def test_bf16_weight_copy_on_separate_rollout_devices(tmp_path):
    """With mesh.rollout_devices the bf16 copy is made before the transfer: half the bytes cross, the actor keeps
    float32 on the training devices."""
    cfg = make_config(str(tmp_path / "run"), **{"mesh.rollout_devices": 4, "mesh.tensor": 1,
                                                "actor_rollout_ref.rollout.weight_dtype": BF16,
                                                "trainer.total_training_steps": 1})
    trainer = Trainer(cfg)
    try:
        trainer.fit()
        weights = trainer.rollouts.weights()
        rollout_devices = set(trainer.rollouts.rollout_mesh.devices.flat)
        floats = [x for x in jax.tree.leaves(weights) if jnp.issubdtype(x.dtype, jnp.floating)]
        assert floats and all(x.dtype == jnp.bfloat16 and x.sharding.device_set <= rollout_devices for x in floats)
        assert {str(x.dtype) for x in jax.tree.leaves(trainer.actor.params)} == {"float32"}
        m = read_metrics(trainer.loop.out_dir)[-1]
        assert 1e-7 < m["training/rollout_probs_diff_mean"] and m["rollout_corr/k3_kl"] > 1e-8  # bf16 weights sampled
    finally:
        trainer.close()
