"""Advantage estimators vs float64 NumPy loop references, plus hand-checked cases."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos import ADV_ESTIMATORS, check_adv_estimator, compute_advantages, register_adv_estimator

from .algos_testdata import ATOL, RTOL, groups_of, ragged_mask, random_groups

B, T = 14, 9


# ----------------------------------------------------------------------------- float64 references
def whiten_ref(x, m):
    vals = [x[i, t] for i in range(x.shape[0]) for t in range(x.shape[1]) if m[i, t] > 0]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    return (x - mean) / np.sqrt(var + 1e-8)


def gae_ref(r, v, m, gamma, lam):
    b, t = r.shape
    adv = np.zeros((b, t))
    for i in range(b):
        next_v, last = 0.0, 0.0
        for k in reversed(range(t)):
            if m[i, k] > 0:  # only response tokens advance the recursion
                delta = r[i, k] + gamma * next_v - v[i, k]
                last = delta + gamma * lam * last
                next_v = v[i, k]
            adv[i, k] = last
    return whiten_ref(adv, m), adv + v


def mean_std(xs):
    n = len(xs)
    mu = sum(xs) / n
    sd = np.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return mu, sd


def grpo_ref(r, m, g, norm=True):
    s = r.sum(-1)
    a = np.zeros(len(s))
    for rows in groups_of(g).values():
        mu, sd = mean_std([s[i] for i in rows]) if len(rows) > 1 else (0.0, 1.0)
        for i in rows:
            a[i] = (s[i] - mu) / (sd + 1e-6) if norm else s[i] - mu
    return a[:, None] * m, a[:, None] * m


def rloo_ref(r, m, g):
    s = r.sum(-1)
    a = s.copy()
    for rows in groups_of(g).values():
        if len(rows) > 1:
            for i in rows:
                a[i] = s[i] - np.mean([s[j] for j in rows if j != i])
    return a[:, None] * m, a[:, None] * m


def rloo_vectorized_ref(r, m, g):
    """verl's compute_rloo_vectorized_outcome_advantage: ((c s - sum) / max(c - 1, 1)) * (c > 1)."""
    s = r.sum(-1)
    a = np.zeros(len(s))
    for rows in groups_of(g).values():
        c = len(rows)
        for i in rows:
            a[i] = (c * s[i] - sum(s[j] for j in rows)) / max(c - 1, 1) if c > 1 else 0.0
    return a[:, None] * m, a[:, None] * m


def grpo_vectorized_ref(r, m, g):
    """verl's compute_grpo_vectorized_outcome_advantage through verl.utils.groupwise.group_mean_std (eps=0):
    mean = sum / count, std = sqrt(max(sum of squared deviations / max(count - 1, 1), 0)), a group of one mean 0
    and std 1, then (s - mean) / (std + 1e-6)."""
    s = r.sum(-1)
    a = np.zeros(len(s))
    for rows in groups_of(g).values():
        c = len(rows)
        mean = sum(s[i] for i in rows) / c
        std = np.sqrt(max(sum((s[i] - mean) ** 2 for i in rows) / max(c - 1, 1), 0.0))
        if c <= 1:
            mean, std = 0.0, 1.0
        for i in rows:
            a[i] = (s[i] - mean) / (std + 1e-6)
    return a[:, None] * m, a[:, None] * m


def rpp_ref(r, m, gamma):
    b, t = r.shape
    ret = np.zeros((b, t))
    for i in range(b):
        running = 0.0
        for k in reversed(range(t)):
            running = r[i, k] + gamma * running
            ret[i, k] = running
            if m[i, k] == 0:
                running = 0.0
    return whiten_ref(ret, m) * m, ret


def rpp_baseline_ref(r, m, g):
    s = r.sum(-1)
    a = np.zeros(len(s))
    for rows in groups_of(g).values():
        mu = np.mean([s[i] for i in rows]) if len(rows) > 1 else 0.0
        for i in rows:
            a[i] = s[i] - mu
    adv = whiten_ref(a[:, None] * m, m) * m
    return adv, adv


def remax_ref(r, m, base):
    b, t = r.shape
    ret = np.zeros((b, t))
    for i in range(b):
        for k in range(t):
            ret[i, k] = sum(r[i, j] * m[i, j] for j in range(k, t))
    return ret - base[:, None] * m, ret


def opo_ref(r, m, g):
    s, ln = r.sum(-1), m.sum(-1)
    a = np.zeros(len(s))
    for rows in groups_of(g).values():
        den = sum(ln[i] for i in rows)
        bsl = sum(ln[i] * s[i] for i in rows) / den if len(rows) > 1 and den > 0 else 0.0
        for i in rows:
            a[i] = s[i] - bsl
    return a[:, None] * m, a[:, None] * m


def gpg_ref(r, m, g):
    s = r.sum(-1)
    alpha = len(s) / max(1, int(np.count_nonzero(s)))
    a = np.zeros(len(s))
    for rows in groups_of(g).values():
        mu = np.mean([s[i] for i in rows]) if len(rows) > 1 else 0.0
        for i in rows:
            a[i] = alpha * (s[i] - mu)
    return a[:, None] * m, a[:, None] * m


def passk_ref(r, m, g, norm=True):
    s = r.sum(-1)
    a = np.zeros(len(s))
    for rows in groups_of(g).values():
        if len(rows) < 2:
            continue
        vals = sorted(((s[i], -i) for i in rows), reverse=True)
        best = -vals[0][1]
        gap = vals[0][0] - vals[1][0]
        if norm:
            gap /= mean_std([s[i] for i in rows])[1] + 1e-6
        a[best] = gap
    return a[:, None] * m, a[:, None] * m


def make_inputs(seed, zero_rewards=False, sparse=False):
    rng = np.random.default_rng(seed)
    m = ragged_mask(rng, B, T, holes=seed % 2 == 1)
    r = rng.normal(size=(B, T)) * m
    if sparse:  # outcome reward on one token, some exact zeros (gpg's nonzero count)
        r = np.zeros((B, T))
        r[:, 0] = rng.choice([0.0, 1.0, 0.5], size=B)
    if zero_rewards:
        r = np.zeros((B, T))
    return dict(r=r, m=m, g=random_groups(rng, B), v=rng.normal(size=(B, T)), base=rng.normal(size=B))


def reference(name, d, gamma, lam):
    r, m, g = d["r"], d["m"].astype(np.float64), d["g"]
    return {
        "gae": lambda: gae_ref(r, d["v"], m, gamma, lam),
        "grpo": lambda: grpo_ref(r, m, g),
        "rloo": lambda: rloo_ref(r, m, g),
        "reinforce_plus_plus": lambda: rpp_ref(r, m, gamma),
        "reinforce_plus_plus_baseline": lambda: rpp_baseline_ref(r, m, g),
        "remax": lambda: remax_ref(r, m, d["base"]),
        "opo": lambda: opo_ref(r, m, g),
        "gpg": lambda: gpg_ref(r, m, g),
        "grpo_passk": lambda: passk_ref(r, m, g),
        "grpo_vectorized": lambda: grpo_vectorized_ref(r, m, g),
        "rloo_vectorized": lambda: rloo_vectorized_ref(r, m, g),
    }[name]()


BUILTIN = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg",
           "grpo_passk", "grpo_vectorized", "rloo_vectorized"]


@functools.lru_cache(maxsize=None)
def jitted(name, gamma, lam, opts):
    """One compiled function per configuration (inputs of equal shape reuse it across seeds)."""
    return jax.jit(
        lambda r, m, g, v, b: compute_advantages(name, token_level_rewards=r, response_mask=m, group_ids=g, values=v,
                                                 gamma=gamma, lam=lam, reward_baselines=b, **dict(opts)))


def run_jit(name, d, gamma=1.0, lam=1.0, **opts):
    f = jitted(name, gamma, lam, tuple(sorted(opts.items())))
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return f(f32(d["r"]), f32(d["m"]), jnp.asarray(d["g"]), f32(d["v"]), f32(d["base"]))


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimator_matches_float64_reference(name, seed):
    d = make_inputs(seed, sparse=(seed == 2))
    gamma, lam = (0.9, 0.8) if seed == 1 else (1.0, 1.0)
    adv, ret = run_jit(name, d, gamma, lam)
    ref_adv, ref_ret = reference(name, d, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_and_passk_std_option(norm):
    d = make_inputs(5)
    adv, _ = run_jit("grpo", d, norm_adv_by_std_in_grpo=norm)
    np.testing.assert_allclose(np.asarray(adv), grpo_ref(d["r"], d["m"], d["g"], norm)[0], rtol=RTOL, atol=ATOL)
    adv, _ = run_jit("grpo_passk", d, norm_adv_by_std_in_grpo=norm)
    np.testing.assert_allclose(np.asarray(adv), passk_ref(d["r"], d["m"], d["g"], norm)[0], rtol=RTOL, atol=ATOL)


def test_gae_skips_masked_tokens_by_hand():
    # t=2: delta = 2 + 0 - 1 = 1; t=1 is masked (reward 5, value 9 ignored, carry kept);
    # t=0: delta = 1 + 0.5 * 1 - 0.5 = 1, A = 1 + 0.5 * 1 * 1 = 1.5.
    r = jnp.array([[1.0, 5.0, 2.0]])
    v = jnp.array([[0.5, 9.0, 1.0]])
    m = jnp.array([[1.0, 0.0, 1.0]])
    _, ret = compute_advantages("gae", token_level_rewards=r, response_mask=m, values=v, gamma=0.5, lam=1.0)
    np.testing.assert_allclose(np.asarray(ret), [[1.5 + 0.5, 1.0 + 9.0, 1.0 + 1.0]], rtol=1e-6)


def test_rloo_is_leave_one_out_by_hand():
    r = jnp.array([[1.0, 0.0], [2.0, 0.0], [4.0, 0.0], [7.0, 0.0]])
    m = jnp.ones((4, 2))
    adv, _ = compute_advantages("rloo", token_level_rewards=r, response_mask=m, group_ids=jnp.array([3, 3, 8, 3]))
    # group 3 = {1, 2, 7}: 1 - 4.5, 2 - 4, 7 - 1.5; group 8 has one sample: unchanged.
    np.testing.assert_allclose(np.asarray(adv[:, 0]), [-3.5, -2.0, 4.0, 5.5], rtol=1e-6)


def test_grpo_group_of_one_and_equal_group_by_hand():
    r = jnp.array([[3.0], [1.0], [1.0], [1.0]])
    adv, _ = compute_advantages("grpo", token_level_rewards=r, response_mask=jnp.ones((4, 1)),
                                group_ids=jnp.array([0, 1, 1, 1]))
    np.testing.assert_allclose(np.asarray(adv[:, 0]), [3.0 / (1 + 1e-6), 0.0, 0.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("name", BUILTIN)
def test_no_nan_on_zero_rewards_and_equal_groups(name):
    d = make_inputs(3, zero_rewards=True)
    adv, ret = run_jit(name, d)
    assert np.isfinite(np.asarray(adv)).all() and np.isfinite(np.asarray(ret)).all()
    d = make_inputs(4)
    d["r"] = np.zeros_like(d["r"])
    d["r"][:, 0] = 0.7  # every group has all-equal scores
    adv, ret = run_jit(name, d)
    assert np.isfinite(np.asarray(adv)).all() and np.isfinite(np.asarray(ret)).all()


def test_group_order_does_not_matter():
    d = make_inputs(6)
    perm = np.random.default_rng(6).permutation(B)
    adv, _ = run_jit("grpo", d)
    d2 = {k: (v[perm] if k != "base" else v[perm]) for k, v in d.items()}
    adv2, _ = run_jit("grpo", d2)
    np.testing.assert_allclose(np.asarray(adv)[perm], np.asarray(adv2), rtol=1e-6, atol=1e-6)


def test_missing_inputs_and_unknown_names_raise():
    r, m = jnp.ones((2, 3)), jnp.ones((2, 3))
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantages("remax", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="algorithm.adv_estimator.*grpo.*rloo"):
        check_adv_estimator("gpro")
    with pytest.raises(ValueError, match="registered"):
        compute_advantages("nope", token_level_rewards=r, response_mask=m)


def test_user_registered_estimator_is_selected_by_name():
    @register_adv_estimator("test_scaled_score", overwrite=True)
    def scaled(*, token_level_rewards, response_mask, scale=1.0, **_):
        adv = scale * jnp.sum(token_level_rewards, -1, keepdims=True) * response_mask
        return adv, adv

    assert "test_scaled_score" in ADV_ESTIMATORS.names()
    check_adv_estimator("test_scaled_score")
    r = jnp.array([[1.0, 2.0], [3.0, 0.0]])
    adv, _ = jax.jit(lambda r: compute_advantages("test_scaled_score", token_level_rewards=r,
                                                  response_mask=jnp.ones((2, 2)), scale=2.0))(r)
    np.testing.assert_allclose(np.asarray(adv), [[6.0, 6.0], [6.0, 6.0]])


def test_vectorized_rloo_gives_a_group_of_one_zero_where_rloo_keeps_its_score():
    d = dict(r=np.array([[2.0, 0.0], [1.0, 0.0], [3.0, 0.0]]), m=np.ones((3, 2)), g=np.array([0, 0, 1]),
             v=np.zeros((3, 2)), base=np.zeros(3))
    plain, _ = run_jit("rloo", d)
    vectorized, _ = run_jit("rloo_vectorized", d)
    np.testing.assert_allclose(np.asarray(plain)[:, 0], [1.0, -1.0, 3.0])
    np.testing.assert_allclose(np.asarray(vectorized)[:, 0], [1.0, -1.0, 0.0])


def gdpo_ref(m, g, components, weights, norm=True):
    """verl's compute_gdpo_outcome_advantage: per component, GRPO's group normalisation of the component's score;
    the weighted sum; verl_F.masked_whiten (unbiased variance, 1e-8) over the response tokens, times the mask."""
    total = np.zeros(m.shape)
    for k, w in enumerate(weights):
        r = np.zeros(m.shape)
        r[:, 0] = components[:, k]  # one score per row (verl puts it on the last response token)
        total += w * grpo_ref(r, m, g, norm)[0]
    adv = whiten_ref(total, m) * m
    return adv, adv


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0), (0.5, 2.0, 1.0)])
def test_gdpo_matches_float64_reference(seed, weights):
    d = make_inputs(seed)
    rng = np.random.default_rng(100 + seed)
    components = rng.choice([0.0, 0.5, 1.0], size=(B, 3))
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    adv, ret = compute_advantages("gdpo", token_level_rewards=f32(d["r"]), response_mask=f32(d["m"]),
                                  group_ids=jnp.asarray(d["g"]), reward_components=f32(components),
                                  reward_weights=weights)
    ref_adv, ref_ret = gdpo_ref(d["m"].astype(np.float64), d["g"], components, weights)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=RTOL, atol=ATOL)


def test_gdpo_without_components_whitens_grpo_of_the_summed_reward():
    d = make_inputs(4)
    adv, _ = run_jit("gdpo", d)
    m = d["m"].astype(np.float64)
    want = whiten_ref(grpo_ref(d["r"], m, d["g"])[0], m) * m
    np.testing.assert_allclose(np.asarray(adv), want, rtol=RTOL, atol=ATOL)
