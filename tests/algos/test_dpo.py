"""DPO loss and metrics against a float64 NumPy reference written from the formulas (and TRL's metric names)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos.dpo import LOSS_TYPES, dpo_loss

B = 24


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def reference(pc, pr, rc, rr, beta, eps, loss_type, weights):
    """float64 reference of the DPO loss (mean over counted pairs) and TRL's metrics."""
    m = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        losses = -(1 - eps) * log_sigmoid(beta * m) - eps * log_sigmoid(-beta * m)
    elif loss_type == "hinge":
        losses = np.maximum(0.0, 1 - beta * m)
    else:
        losses = (m - 1 / (2 * beta)) ** 2
    keep = weights > 0
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    return losses[keep].mean(), {
        "rewards/chosen": chosen[keep].mean(), "rewards/rejected": rejected[keep].mean(),
        "rewards/accuracies": (chosen > rejected)[keep].mean(), "rewards/margins": (chosen - rejected)[keep].mean(),
        "logps/chosen": pc[keep].mean(), "logps/rejected": pr[keep].mean(),
    }


def random_logps(rng):
    # Summed log-probs of responses of a few tokens: tens of nats, chosen/rejected close to the reference.
    ref_c, ref_r = -rng.uniform(2, 40, B), -rng.uniform(2, 40, B)
    return ref_c + rng.normal(0, 2, B), ref_r + rng.normal(0, 2, B), ref_c, ref_r


@pytest.mark.parametrize("loss_type,beta,eps", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("sigmoid", 2.0, 0.45),
                                                ("hinge", 0.3, 0.0), ("ipo", 0.1, 0.0)])
def test_loss_and_metrics_match_numpy(loss_type, beta, eps):
    rng = np.random.default_rng()
    pc, pr, rc, rr = random_logps(rng)
    weights = np.ones(B)
    weights[rng.choice(B, 5, replace=False)] = 0.0  # padding pairs are left out of loss and metrics
    want_loss, want = reference(pc, pr, rc, rr, beta, eps, loss_type, weights)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, metrics = jax.jit(lambda *a: dpo_loss(*a, beta=beta, label_smoothing=eps, loss_type=loss_type,
                                                 weights=f32(weights)))(f32(pc), f32(pr), f32(rc), f32(rr))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5, atol=1e-6)
    assert set(metrics) == set(want) | {"loss"}
    for name, value in want.items():
        np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_gradient_matches_numpy():
    """d loss / d policy log-probs of the smoothed sigmoid loss, against the closed form in float64."""
    rng = np.random.default_rng()
    pc, pr, rc, rr = random_logps(rng)
    beta, eps = 0.3, 0.1
    grads = jax.grad(lambda c, r: dpo_loss(c, r, jnp.asarray(rc, jnp.float32), jnp.asarray(rr, jnp.float32),
                                           beta=beta, label_smoothing=eps)[0], argnums=(0, 1))(
        jnp.asarray(pc, jnp.float32), jnp.asarray(pr, jnp.float32))
    z = beta * ((pc - rc) - (pr - rr))
    sig = 1 / (1 + np.exp(-z))
    d_margin = (-(1 - eps) * (1 - sig) + eps * sig) * beta / B  # d/dm of the mean smoothed loss
    np.testing.assert_allclose(np.asarray(grads[0]), d_margin, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grads[1]), -d_margin, rtol=1e-4, atol=1e-7)


def test_micro_batch_sums_give_the_mini_batch_mean():
    rng = np.random.default_rng()
    arrays = [jnp.asarray(x, jnp.float32) for x in random_logps(rng)]
    whole, whole_metrics = dpo_loss(*arrays, beta=0.1, label_smoothing=0.1)
    parts = [dpo_loss(*[x[i::3] for x in arrays], beta=0.1, label_smoothing=0.1, denominator=B) for i in range(3)]
    np.testing.assert_allclose(sum(float(p[0]) for p in parts), float(whole), rtol=1e-5)
    for name, value in whole_metrics.items():
        np.testing.assert_allclose(sum(float(p[1][name]) for p in parts), float(value), rtol=1e-5, atol=1e-6)


def test_unknown_loss_type_is_named():
    x = jnp.zeros(2)
    with pytest.raises(ValueError, match="unknown DPO loss type 'robust'; choose one of " + ", ".join(LOSS_TYPES)):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="robust")
