"""On-policy distillation's loss against float64 references written from verl's distillation losses (commit
1dda039): a single-sample estimator of student vs teacher trained as a loss, or as the reward of PPO's clipped
loss (advantage = -divergence, without gradient), with the optional clamp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos import DistillSpec, distillation_loss

from .algos_testdata import ATOL, RTOL, agg_ref
from .test_policy_losses import make, vanilla_ref


def k3_ref(student, teacher):
    x = np.clip(teacher - student, -20.0, 20.0)
    return np.clip(np.exp(x) - x - 1.0, -10.0, 10.0)


def run(spec, student, old, teacher, m, agg="token-mean"):
    loss, metrics = distillation_loss(spec, jnp.float32(student), jnp.float32(old), jnp.float32(teacher),
                                      jnp.float32(m), agg)
    return float(loss), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed", [0, 1])
def test_k3_as_a_loss_is_the_aggregated_estimator(seed, agg):
    old, student, _, m = make(seed, scale=0.8)
    teacher = old + np.random.default_rng(seed + 10).normal(size=old.shape)
    got, metrics = run(DistillSpec(loss_mode="k3"), student, old, teacher, m, agg)
    d = k3_ref(student, teacher)
    np.testing.assert_allclose(got, agg_ref(d, m, agg), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(metrics["abs_loss"], (np.abs(d) * m).sum() / m.sum(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("seed", [2, 3])
def test_k1_as_a_reward_is_ppo_clip_with_the_negative_divergence_as_advantage(seed):
    old, student, _, m = make(seed, scale=0.6)
    teacher = old + np.random.default_rng(seed + 10).normal(size=old.shape)
    spec = DistillSpec(loss_mode="k1", use_policy_gradient=True, clip_ratio_low=0.1, clip_ratio_high=0.3)
    got, metrics = run(spec, student, old, teacher, m)
    want, (cf, cfl, kl) = vanilla_ref(old, student, -(student - teacher), m, 0.1, 0.3, 3.0, "token-mean")
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose([metrics["pg_clipfrac"], metrics["ppo_kl"]], [cf, kl], rtol=RTOL, atol=ATOL)
    # the advantage carries no gradient: d loss / d student at ratio 1 is -A = (student - teacher), per token mean
    grad = jax.grad(lambda s: distillation_loss(spec, s, jnp.float32(student), jnp.float32(teacher),
                                                jnp.float32(m), "token-mean")[0])(jnp.float32(student))
    np.testing.assert_allclose(np.asarray(grad), (student - teacher) * m / m.sum(), rtol=1e-4, atol=1e-6)


def test_the_clamp_bounds_each_tokens_divergence():
    old, student, _, m = make(4, scale=0.5)
    teacher = student + 8.0  # k3 of a gap this large is far above the clamp
    got, metrics = run(DistillSpec(loss_mode="k3", loss_max_clamp=2.0), student, old, teacher, m)
    np.testing.assert_allclose(got, agg_ref(np.minimum(k3_ref(student, teacher), 2.0), m, "token-mean"), rtol=RTOL)
    assert metrics["abs_loss"] > 2.0  # the metric is taken before the clamp, as verl's
