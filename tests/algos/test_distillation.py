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


# ---------------------------------------------------------------------------- forward_kl_topk
def log_softmax64(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def topk_inputs(seed, B=5, T=6, V=40, k=7):
    """Random student / teacher logits over V tokens: the teacher's top-k ids (np.argsort) and both models' float64
    log-softmax gathered there, and a ragged mask with holes."""
    from .algos_testdata import ragged_mask

    rng = np.random.default_rng(seed)
    student, teacher = log_softmax64(rng.normal(size=(B, T, V)) * 3), log_softmax64(rng.normal(size=(B, T, V)) * 3)
    ids = np.argsort(-teacher, axis=-1)[..., :k]
    return (np.take_along_axis(student, ids, -1), np.take_along_axis(teacher, ids, -1),
            ragged_mask(rng, B, T, holes=True).astype(np.float64))


def topk_ref(s, t, clamp):
    """verl's compute_forward_kl_topk per token, float64 loops: masses before the clamp, both log-probs clamped
    below, sum p_t (log p_t - log p_s), negatives to 0."""
    d, sm, tm = np.zeros(s.shape[:2]), np.zeros(s.shape[:2]), np.zeros(s.shape[:2])
    for i, j in np.ndindex(*s.shape[:2]):
        sm[i, j], tm[i, j] = np.exp(s[i, j]).sum(), np.exp(t[i, j]).sum()
        si, ti = (s[i, j], t[i, j]) if clamp is None else (np.maximum(s[i, j], clamp), np.maximum(t[i, j], clamp))
        d[i, j] = max(0.0, sum(np.exp(ti[v]) * (ti[v] - si[v]) for v in range(s.shape[-1])))
    return d, sm, tm


def run_topk(spec, s, t, m, agg):
    zeros = jnp.zeros(m.shape, jnp.float32)
    loss, metrics = distillation_loss(spec, zeros, zeros, None, jnp.float32(m), agg,
                                      student_topk_log_probs=jnp.float32(s), teacher_topk_log_probs=jnp.float32(t))
    return float(loss), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("clamp", [None, -3.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_forward_kl_topk_is_verls_clamped_sum_over_the_teachers_top_k(seed, clamp, agg):
    s, t, m = topk_inputs(seed)
    got, metrics = run_topk(DistillSpec(loss_mode="forward_kl_topk", log_prob_min_clamp=clamp), s, t, m, agg)
    d, sm, tm = topk_ref(s, t, clamp)
    np.testing.assert_allclose(got, agg_ref(d, m, agg), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose([metrics["student_mass"], metrics["teacher_mass"]],
                               [(sm * m).sum() / m.sum(), (tm * m).sum() / m.sum()], rtol=RTOL, atol=ATOL)
    if clamp is not None:  # the clamp changes the value (some of these log-probs lie below it)
        assert (np.minimum(s, t) < clamp).any() and not np.isclose(got, agg_ref(topk_ref(s, t, None)[0], m, agg))


def test_forward_kl_topk_gradient_reaches_only_the_student_log_probs_the_clamp_keeps():
    s, t, m = topk_inputs(5)
    spec = DistillSpec(loss_mode="forward_kl_topk", log_prob_min_clamp=-4.0, loss_max_clamp=10.0)
    zeros = jnp.zeros(m.shape, jnp.float32)
    grad = np.asarray(jax.grad(lambda x: distillation_loss(
        spec, zeros, zeros, None, jnp.float32(m), "token-mean", student_topk_log_probs=x,
        teacher_topk_log_probs=jnp.float32(t))[0])(jnp.float32(s)))
    d, _, _ = topk_ref(s, t, -4.0)
    # d/ds of sum p_t (t - max(s, c)) = -p_t where s > c (and the token's sum is positive), / mask count
    tc = np.maximum(t, -4.0)
    want = -np.exp(tc) * (s > -4.0) * (d > 0)[..., None] * m[..., None] / m.sum()
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6)


def test_forward_kl_topk_as_a_reward_is_ppo_clip_with_the_negative_topk_divergence():
    s, t, m = topk_inputs(6)
    old, student, _, _ = make(6, scale=0.6)
    old, student = old[:5, :6], student[:5, :6]
    spec = DistillSpec(loss_mode="forward_kl_topk", use_policy_gradient=True, loss_max_clamp=0.5)
    loss, metrics = distillation_loss(spec, jnp.float32(student), jnp.float32(old), None, jnp.float32(m),
                                      "token-mean", student_topk_log_probs=jnp.float32(s),
                                      teacher_topk_log_probs=jnp.float32(t))
    d = np.minimum(topk_ref(s, t, None)[0], 0.5)
    want, (cf, _, kl) = vanilla_ref(old, student, -d, m, 0.2, 0.2, 3.0, "token-mean")
    np.testing.assert_allclose(float(loss), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose([float(metrics["pg_clipfrac"]), float(metrics["ppo_kl"])], [cf, kl], rtol=RTOL,
                               atol=ATOL)
