"""Off-policy correction (algorithm.rollout_correction) against a float64 NumPy reference of verl's formulas."""

import numpy as np
import pytest

import jax.numpy as jnp

from rlhf_jax import algos
from rlhf_jax.algos.rollout_correction import RolloutCorrection, correction_from_config, rollout_correction

BOUND = 20.0


def _mm(x, m, axis=None):
    return (x * m).sum(axis=axis) / np.maximum(m.sum(axis=axis), 1.0)


def _inputs(seed, rows=12, width=10, spread=0.6):
    rng = np.random.default_rng(seed)
    rollout = -rng.gamma(2.0, 0.7, (rows, width))
    old = rollout + rng.normal(0.0, spread, (rows, width))
    lengths = rng.integers(1, width + 1, rows)
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.float64)
    return old, rollout, mask


def _level_lr(lr, mask, level):
    if level == "token":
        return lr
    total = (lr * mask).sum(-1, keepdims=True)
    return total if level == "sequence" else total / np.maximum(mask.sum(-1, keepdims=True), 1.0)


def _stats(prefix, w, level_lr, mask, upper, lower):
    out = {f"{prefix}_mean": _mm(w, mask)}
    if level_lr.shape[-1] == 1:
        lr = level_lr[:, 0]
        out[f"{prefix}_max"] = np.exp(min(lr.max(), BOUND))
        out[f"{prefix}_min"] = np.exp(lr.min())
        out[f"{prefix}_ratio_fraction_high"] = np.mean(lr > np.log(upper))
        out[f"{prefix}_ratio_fraction_low"] = np.mean(lr < np.log(lower))
    else:
        out[f"{prefix}_max"] = w[mask > 0].max()
        out[f"{prefix}_min"] = w[mask > 0].min()
        out[f"{prefix}_ratio_fraction_high"] = _mm((w > upper).astype(float), mask)
        out[f"{prefix}_ratio_fraction_low"] = _mm((w < lower).astype(float), mask)
    c = np.clip(w, lower, upper)
    mean = _mm(c, mask)
    out[f"{prefix}_std"] = np.sqrt(max(_mm(c**2, mask) - mean**2, 0.0))
    out[f"{prefix}_eff_sample_size"] = 1.0 / _mm((c / (mean + 1e-8)) ** 2, mask)
    return out


def reference(old, rollout, mask, cfg: RolloutCorrection):
    """verl's rollout_corr_helper in float64 (every row here has at least one response token)."""
    lr = (old - rollout) * mask
    metrics, weights, kept = {}, None, mask.copy()
    if cfg.rollout_is:
        level = _level_lr(lr, mask, cfg.rollout_is)
        w = np.broadcast_to(np.exp(np.clip(level, -BOUND, BOUND)), mask.shape) * mask
        metrics.update(_stats("rollout_is", w, level, mask, cfg.rollout_is_threshold, 1 / cfg.rollout_is_threshold))
        weights = np.minimum(w, cfg.rollout_is_threshold)
        if cfg.rollout_is_batch_normalize:
            mean = _mm(weights, mask) if cfg.rollout_is == "token" else _mm(weights, mask, axis=-1).mean()
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean
    if cfg.rollout_rs:
        upper = cfg.rollout_rs_threshold
        lower = cfg.rollout_rs_threshold_lower or 1 / upper
        level = _level_lr(lr, mask, cfg.rollout_rs)
        ratio = np.broadcast_to(np.exp(np.clip(level, -BOUND, BOUND)), mask.shape)
        keep = ((ratio >= lower) & (ratio <= upper)).astype(float)
        metrics.update(_stats("rollout_rs", ratio * mask, level, mask, upper, lower))
        metrics["rollout_rs_masked_fraction"] = _mm(1 - keep, mask)
        metrics["rollout_rs_seq_masked_fraction"] = np.mean(((1 - keep) * mask).sum(-1) > 0)
        kept = kept * keep
    if cfg.rollout_token_veto_threshold:
        bad = (lr < np.log(cfg.rollout_token_veto_threshold)) & (mask > 0)
        vetoed = bad.any(-1, keepdims=True)
        metrics["rollout_is_veto_fraction"] = vetoed.mean()
        metrics["rollout_is_catastrophic_token_fraction"] = _mm(bad.astype(float), mask)
        kept = kept * ~vetoed
    lr_full = old - rollout
    mt, mr = _mm(old, mask, axis=-1), _mm(rollout, mask, axis=-1)
    seq = np.clip((lr_full * mask).sum(-1), -BOUND, BOUND)
    metrics.update(kl=_mm(-lr_full, mask), k3_kl=_mm(np.exp(lr_full) - lr_full - 1, mask),
                   training_ppl=np.exp(-mt).mean(), rollout_ppl=np.exp(-mr).mean(), log_ppl_diff=(mr - mt).mean(),
                   log_ppl_abs_diff=np.abs(mr - mt).mean(), ppl_ratio=np.exp(mr - mt).mean(),
                   chi2_token=_mm(np.exp(np.clip(lr_full, -BOUND, BOUND)) ** 2, mask) - 1,
                   chi2_seq=np.exp(2 * seq).mean() - 1)
    return weights, kept, {f"rollout_corr/{k}": v for k, v in metrics.items()}


CASES = [
    RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0),
    RolloutCorrection(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True),
    RolloutCorrection(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                      rollout_token_veto_threshold=0.2),
    RolloutCorrection(rollout_rs="token", rollout_rs_threshold=1.8),
    RolloutCorrection(rollout_rs="sequence", rollout_rs_threshold=4.0, rollout_rs_threshold_lower=0.1),
    RolloutCorrection(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="geometric", rollout_rs_threshold=1.3,
                      rollout_token_veto_threshold=0.05),
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"is={c.rollout_is},rs={c.rollout_rs},veto={c.rollout_token_veto_threshold}")
def test_weights_masks_and_metrics_match_float64_reference(cfg):
    old, rollout, mask = _inputs(seed=CASES.index(cfg))
    want_w, want_mask, want_metrics = reference(old, rollout, mask, cfg)
    w, kept, metrics = rollout_correction(jnp.asarray(old, jnp.float32), jnp.asarray(rollout, jnp.float32),
                                          jnp.asarray(mask, jnp.int32), cfg)
    if want_w is None:
        assert w is None
    else:
        np.testing.assert_allclose(np.asarray(w), want_w, rtol=2e-5, atol=1e-6)
        assert np.all(np.asarray(w)[mask == 0] == 0)
    np.testing.assert_array_equal(np.asarray(kept), want_mask.astype(np.int32))
    assert set(metrics) == set(want_metrics)
    for k, v in want_metrics.items():
        np.testing.assert_allclose(float(metrics[k]), v, rtol=1e-4, atol=1e-6, err_msg=k)
    # The inputs exercise both sides of every threshold.
    if cfg.rollout_is:
        assert 0 < want_metrics["rollout_corr/rollout_is_ratio_fraction_high"] < 1
    if cfg.rollout_rs:
        assert 0 < want_metrics["rollout_corr/rollout_rs_masked_fraction"] < 1


def test_identical_policies_give_unit_weights_and_keep_everything():
    _, rollout, mask = _inputs(seed=3)
    cfg = RolloutCorrection(rollout_is="sequence", rollout_rs="token", rollout_rs_threshold=1.01)
    w, kept, metrics = rollout_correction(jnp.asarray(rollout, jnp.float32), jnp.asarray(rollout, jnp.float32),
                                          jnp.asarray(mask), cfg)
    np.testing.assert_array_equal(np.asarray(w), mask)
    np.testing.assert_array_equal(np.asarray(kept), mask)
    assert abs(float(metrics["rollout_corr/kl"])) < 1e-7 and float(metrics["rollout_corr/rollout_is_mean"]) == 1.0


def test_policy_loss_scales_each_token_by_its_weight():
    rng = np.random.default_rng(7)
    old, new = -rng.gamma(2.0, 0.5, (6, 9)), -rng.gamma(2.0, 0.5, (6, 9))
    adv, w = rng.normal(size=(6, 9)), rng.uniform(0.2, 2.0, (6, 9))
    mask = (rng.uniform(size=(6, 9)) < 0.8).astype(np.float64)
    ratio = np.exp(new - old)
    per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
    per_token = np.where(adv < 0, np.minimum(-adv * 3.0, per_token), per_token)
    for mode, want in (("token-mean", (w * per_token * mask).sum() / mask.sum()),
                       ("seq-mean-token-sum", ((w * per_token * mask).sum(-1)).mean())):
        loss, _ = algos.policy_loss("vanilla", old_log_prob=jnp.asarray(old, jnp.float32),
                                    log_prob=jnp.asarray(new, jnp.float32), advantages=jnp.asarray(adv, jnp.float32),
                                    response_mask=jnp.asarray(mask), loss_agg_mode=mode,
                                    rollout_is_weights=jnp.asarray(w, jnp.float32))
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)


@pytest.mark.parametrize("section,cap,key", [
    (dict(rollout_is="tokens"), -1, r"algorithm\.rollout_correction\.rollout_is='tokens'"),
    (dict(rollout_rs="token"), -1, r"algorithm\.rollout_correction\.rollout_rs=token needs rollout_rs_threshold"),
    (dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0), -1,
     r"rollout_rs_threshold_lower=3\.0"),
    (dict(rollout_is="token", rollout_is_threshold=0.0), -1, r"rollout_is_threshold=0\.0 must be > 0"),
    (dict(rollout_is="sequence"), 2.0, r"tis_imp_ratio_cap and algorithm\.rollout_correction\.rollout_is"),
])
def test_bad_settings_name_the_key(section, cap, key):
    full = {f: None for f in ("rollout_is", "rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower",
                              "rollout_token_veto_threshold")}
    full.update(rollout_is_threshold=2.0, rollout_is_batch_normalize=False)
    full.update(section)
    with pytest.raises(ValueError, match=key):
        correction_from_config(full, cap)


def test_legacy_tis_cap_is_token_level_truncation():
    full = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
                rollout_rs_threshold=None, rollout_rs_threshold_lower=None, rollout_token_veto_threshold=None)
    assert correction_from_config(full, 1.5) == RolloutCorrection(rollout_is="token", rollout_is_threshold=1.5)
    assert not correction_from_config(full, -1).enabled


@pytest.mark.parametrize("seed", [0, 1])
def test_mismatch_metrics_are_verls_probability_differences(seed):
    from rlhf_jax.algos.rollout_correction import mismatch_metrics

    old, rollout, mask = _inputs(seed, spread=0.05)
    got = {k: float(v) for k, v in mismatch_metrics(jnp.asarray(old, jnp.float32), jnp.asarray(rollout, jnp.float32),
                                                     jnp.asarray(mask)).items()}
    # verl: torch.masked_select(|exp(rollout) - exp(old)|, mask), then max / mean / std (unbiased); Pearson of the probs
    p_old, p_rollout = np.exp(old)[mask > 0], np.exp(rollout)[mask > 0]
    diff = np.abs(p_rollout - p_old)
    want = {"training/rollout_probs_diff_max": diff.max(), "training/rollout_probs_diff_mean": diff.mean(),
            "training/rollout_probs_diff_std": diff.std(ddof=1),
            "training/rollout_actor_probs_pearson_corr": np.corrcoef(p_old, p_rollout)[0, 1],
            "rollout_corr/kl": _mm(rollout - old, mask), "rollout_corr/k3_kl": _mm(np.exp(old - rollout) - (old - rollout) - 1, mask)}
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
