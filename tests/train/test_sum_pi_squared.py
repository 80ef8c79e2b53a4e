"""sum_v pi_v^2 per token from the old-log-prob pass (verl's actor.calculate_sum_pi_squared): against transformers'
logits in float64, and through the command line in both layouts, feeding the optimal-token-baseline estimators and
verl's variance_proxy/ metrics."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from rlhf_jax.models import from_pretrained
from rlhf_jax.train import steps
from tests.conftest import left_padded_batch
from tests.train.helpers import read_metrics, run_main
from tests.train.test_new_policy_losses_cli import ONE_STEP


def test_sums_of_squared_probabilities_match_transformers(hf_checkpoint):
    path, torch_model = hf_checkpoint("llama")
    model = from_pretrained(path)
    ids, mask = left_padded_batch(np.random.default_rng(0), model.config.vocab_size, [7, 5, 9])
    R, temperature = 4, 0.7
    logp, squares = steps.response_log_probs(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(ids[:, -R:]),
                                             temperature, False, with_sum_pi_squared=True)
    with torch.no_grad():
        positions = np.clip(np.cumsum(mask, -1) - 1, 0, None)
        logits = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             position_ids=torch.tensor(positions)).logits.double().numpy()
    z = logits[:, -R - 1:-1] / temperature
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    want_logp = np.log(np.take_along_axis(p, ids[:, -R:, None], -1)[..., 0])
    np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.asarray(squares), (p**2).sum(-1), rtol=1e-5, atol=1e-6)


LENGTH_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 10.0
'''


def test_optimal_token_baseline_runs_and_both_layouts_compute_the_same_squares(tmp_path):
    reward = tmp_path / "length.py"
    reward.write_text(LENGTH_REWARD)
    common = [*ONE_STEP, f"reward.custom_reward_function.path={reward}", "data.max_response_length=6"]
    rows = {}
    for name, args in {"tir_padded": ["algorithm.adv_estimator=tir_optimal_token_baseline",
                                      "actor_rollout_ref.model.use_remove_padding=False"],
                       "grpo_packed": ["+actor_rollout_ref.actor.calculate_sum_pi_squared=True",
                                       "actor_rollout_ref.model.use_remove_padding=True"]}.items():
        out = tmp_path / name
        proc = run_main([*common, *args, f"trainer.default_local_dir={out}"], devices=1)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        (rows[name],) = read_metrics(str(out))
    tir, grpo = rows["tir_padded"], rows["grpo_packed"]
    assert tir["critic/advantages/max"] > tir["critic/advantages/min"]  # a real baseline over varying rewards
    assert math.isfinite(tir["actor/pg_loss"]) and tir["variance_proxy/proxy2_total_power"] > 0
    # the same samples (the seed decides them before the estimator) give the same path variance in either layout
    assert math.isclose(tir["variance_proxy/expected_w"], grpo["variance_proxy/expected_w"], rel_tol=1e-5)
    assert grpo["variance_proxy/proxy1_signal_strength"] == grpo["actor/grad_norm"] ** 2 > 0


def test_variance_proxies_with_importance_weights_follow_verls_formulas():
    from rlhf_jax.train.metrics import variance_proxy_metrics

    old = np.log(np.array([[0.5, 0.25, 0.9], [0.2, 0.6, 0.1]]))
    squares = np.array([[0.3, 0.2, 0.8], [0.1, 0.4, 0.5]])
    adv = np.array([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    rho = np.array([[1.0, 2.0, 1.0], [0.5, 0.5, 1.0]])
    # w = 1 - 2 pi + sum pi^2 = [[0.3, 0.7, (masked)], [0.7, 0.2, 1.3]]
    out = variance_proxy_metrics(old, squares, adv, mask, rho, grad_norm=0.5)
    a = np.array([1.0, -2.0])  # each response's mean advantage
    w_plain = np.array([0.3 + 0.7, 0.7 + 0.2 + 1.3])
    rho_mean = np.array([1.5, 2.0 / 3.0])
    total = np.mean(rho_mean**2 * a**2 * w_plain)
    np.testing.assert_allclose(out["variance_proxy/proxy2_total_power"], total, rtol=1e-6)
    np.testing.assert_allclose(out["variance_proxy/expected_w"],
                               np.mean([0.3 * 1 + 0.7 * 4, 0.7 * 0.25 + 0.2 * 0.25 + 1.3]), rtol=1e-6)
    np.testing.assert_allclose(out["variance_proxy/proxy3_pure_noise"], max(0.0, total - 0.25), rtol=1e-6)
    np.testing.assert_allclose(out["variance_proxy/expected_a_squared"], 2.5, rtol=1e-6)
