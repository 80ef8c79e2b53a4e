"""verl's bypass mode (old log-probs = the sampler's, the correction against the current policy inside the loss)
against float64 references written from verl's compute_policy_loss_bypass_mode: PPO-clip without importance
weights, REINFORCE with them, rejection leaving the loss's mask in both."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos import policy_loss
from rlhf_jax.algos.rollout_correction import RolloutCorrection

from .algos_testdata import ATOL, RTOL, agg_ref
from .test_policy_losses import make, mmean, vanilla_ref

UPPER, IS_CAP = 1.6, 1.3
CORRECTION = RolloutCorrection(rollout_is="token", rollout_is_threshold=IS_CAP, rollout_rs="token",
                               rollout_rs_threshold=UPPER)


def kept_ref(rollout, lp, m):
    """Token rejection: tokens whose ratio current / sampler is outside [1 / UPPER, UPPER] leave the mask."""
    ratio = np.exp(np.clip(lp - rollout, -20.0, 20.0))
    return m * ((ratio >= 1.0 / UPPER) & (ratio <= UPPER))


def bypass(rollout, lp, A, m, loss_type, agg="token-mean"):
    return policy_loss("bypass_mode", old_log_prob=jnp.float32(rollout), log_prob=lp, advantages=jnp.float32(A),
                       response_mask=jnp.float32(m), loss_agg_mode=agg, correction=CORRECTION, loss_type=loss_type)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_clip_is_vanilla_ppo_against_the_sampler_on_the_kept_tokens(seed, agg):
    rollout, lp, A, m = make(seed, scale=0.6)
    kept = kept_ref(rollout, lp, m)
    assert 0 < kept.sum() < m.sum()  # some tokens rejected, some kept
    want, (cf, cfl, kl) = vanilla_ref(rollout, lp, A, kept, 0.2, 0.2, 3.0, agg)
    loss, met = bypass(rollout, jnp.float32(lp), A, m, "ppo_clip", agg)
    np.testing.assert_allclose(float(loss), want, rtol=RTOL, atol=ATOL)  # no importance weights (the ratio is one)
    np.testing.assert_allclose([float(met["pg_clipfrac"]), float(met["ppo_kl"])], [cf, kl], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(met["rollout_corr/rollout_rs_masked_fraction"]), 1 - kept.sum() / m.sum(),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("seed", [2, 3])
def test_reinforce_weights_minus_a_log_pi_by_the_truncated_ratio_and_its_gradient_stops_at_the_weights(seed):
    rollout, lp, A, m = make(seed, scale=0.6)
    kept = kept_ref(rollout, lp, m)
    w = np.minimum(np.exp(lp - rollout), IS_CAP)
    want = agg_ref(-A * lp * w, kept, "token-mean")
    loss, met = bypass(rollout, jnp.float32(lp), A, m, "reinforce")
    np.testing.assert_allclose(float(loss), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(met["ppo_kl"]), mmean(rollout - lp, kept), rtol=RTOL, atol=ATOL)
    grad = jax.grad(lambda x: bypass(rollout, x, A, m, "reinforce")[0])(jnp.float32(lp))
    np.testing.assert_allclose(np.asarray(grad), -A * w * kept / kept.sum(), rtol=1e-4, atol=1e-6)


def test_an_unknown_loss_type_names_its_key():
    rollout, lp, A, m = make(0)
    with pytest.raises(ValueError, match=r"^algorithm.rollout_correction.loss_type='pg': choose ppo_clip or reinforce"):
        bypass(rollout, jnp.float32(lp), A, m, "pg")


def test_without_correction_settings_ppo_clip_equals_vanilla_with_the_samplers_log_probs():
    rollout, lp, A, m = make(4, scale=0.6)
    got = policy_loss("bypass_mode", old_log_prob=jnp.float32(rollout), log_prob=jnp.float32(lp),
                      advantages=jnp.float32(A), response_mask=jnp.float32(m))[0]
    want = policy_loss("vanilla", old_log_prob=jnp.float32(rollout), log_prob=jnp.float32(lp),
                       advantages=jnp.float32(A), response_mask=jnp.float32(m))[0]
    assert math.isclose(float(got), float(want), rel_tol=1e-6)
