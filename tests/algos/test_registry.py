"""Registries: decorators, selection by config string, errors listing registered names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.algos import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    agg_loss,
    check_kl_kind,
    effective_loss_agg_mode,
    kl_penalty,
    policy_loss,
    register_kl_estimator,
    register_policy_loss,
)


def test_builtin_names_are_registered():
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg",
            "grpo_passk"} <= set(ADV_ESTIMATORS.names())
    assert {"vanilla", "gspo", "gpg", "cispo", "clip_cov", "kl_cov"} <= set(POLICY_LOSSES.names())
    assert {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"} <= set(KL_ESTIMATORS.names())


def test_registry_semantics():
    reg = Registry("widget", "a.b.widget")
    f = reg.register("one")(lambda: 1)
    assert reg.get("one") is f and "one" in reg
    reg.register("one")(f)  # same function again: fine
    with pytest.raises(ValueError, match="already registered"):
        reg.register("one")(lambda: 2)
    g = reg.register("one", overwrite=True)(lambda: 3)
    assert reg.get("one")() == 3 and g() == 3
    with pytest.raises(ValueError, match=r"unknown widget 'two' \(config key a\.b\.widget\); registered: one"):
        reg.check("two")
    with pytest.raises(ValueError, match="non-empty"):
        reg.register("")


def test_user_policy_loss_selected_by_config_string_under_jit():
    @register_policy_loss("test_weighted_pg", overwrite=True)
    def weighted_pg(*, log_prob, advantages, response_mask, loss_agg_mode, denominator=None, weight=1.0, **_):
        loss = agg_loss(-weight * log_prob * advantages, response_mask, loss_agg_mode, denominator=denominator)
        return loss, {"pg_clipfrac": jnp.float32(0), "pg_clipfrac_lower": jnp.float32(0), "ppo_kl": jnp.float32(0)}

    rng = np.random.default_rng(0)
    lp, a = jnp.float32(rng.normal(size=(3, 4))), jnp.float32(rng.normal(size=(3, 4)))
    m = jnp.float32(np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]))
    loss, _ = jax.jit(lambda lp, a, m: policy_loss("test_weighted_pg", old_log_prob=lp, log_prob=lp, advantages=a,
                                                   response_mask=m, weight=2.0))(lp, a, m)
    want = -2.0 * np.sum(np.asarray(lp * a * m)) / 6.0
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    assert effective_loss_agg_mode("test_weighted_pg", "seq-mean-token-sum") == "seq-mean-token-sum"


def test_user_kl_estimator_with_straight_through_suffix():
    @register_kl_estimator("test_sq", overwrite=True)
    def sq(lp, ref):
        return (lp - ref) ** 2

    check_kl_kind("test_sq+")
    lp, ref = jnp.float32([0.5, -1.0]), jnp.float32([0.0, 0.0])
    np.testing.assert_allclose(np.asarray(kl_penalty(lp, ref, "test_sq+")), [0.25, 1.0])
    g = jax.grad(lambda x: jnp.sum(kl_penalty(x, ref, "test_sq+")))(lp)
    np.testing.assert_allclose(np.asarray(g), [0.5, -1.0])  # gradient of 0.5 d^2


def test_algos_imports_only_jax_numpy_and_stdlib():
    """algos/ is the functional core: nothing from the rest of rlhf_jax, no third-party beyond jax/numpy."""
    import ast
    import pathlib
    import sys

    import rlhf_jax.algos

    allowed = {"jax", "numpy"} | set(sys.stdlib_module_names)
    for path in pathlib.Path(rlhf_jax.algos.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            assert all(r in allowed for r in roots), f"{path.name}:{node.lineno} imports {roots}"
