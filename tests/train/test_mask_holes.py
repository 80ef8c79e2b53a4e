"""Loss masks with holes (multi-turn rollouts: tool responses are in the sequence but not trained).

The attention mask covers every response token (``response_valid``, contiguous); ``response_mask`` marks the
trained ones. Tool positions get exactly zero gradient, every token mean counts trained tokens only (float64
NumPy reference), group advantages are per trajectory, and packed passes (laid out by the valid tokens) equal the
padded ones (attention by the valid tokens) on such batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax import algos
from rlhf_jax.rewards.shaping import place_on_last_token
from rlhf_jax.rollout.decode import RolloutBatch
from rlhf_jax.parallel.hosts import to_global
from rlhf_jax.train import losses
from rlhf_jax.train.steps import actor_denominators, actor_loss
from rlhf_jax.types import TrainBatch

from tests.train.helpers import loss_specs

from .test_packing import DP, N, R, _micros, _role, assert_grads_close, ragged_batch


def with_holes(host: dict, seed: int) -> dict:
    """``response_valid`` = the contiguous responses; ``response_mask`` with a tool span cut out of rows of 4+ tokens."""
    rng = np.random.default_rng(seed)
    valid = host["response_mask"].copy()
    trained = valid.copy()
    for i in range(valid.shape[0]):
        r = int(valid[i].sum())
        if r >= 4:
            a = int(rng.integers(1, r - 2))
            trained[i, a:int(rng.integers(a + 1, r))] = 0
    assert (trained.sum() < valid.sum()) and (trained[:, 0] == valid[:, 0]).all()
    return {**host, "response_valid": valid, "response_mask": trained,
            "advantages": host["advantages"] * trained, "returns": host["returns"] * trained}


def _np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_tool_positions_get_zero_gradient_and_denominators_count_trained_tokens(agg):
    rng = np.random.default_rng(0)
    B, T, V = 5, 9, 11
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    tokens = rng.integers(0, V, (B, T))
    valid = (np.arange(T)[None, :] < rng.integers(3, T + 1, B)[:, None]).astype(np.float32)
    trained = valid.copy()
    trained[:, 2:4] = 0  # a tool response in every row
    old = (_np_log_softmax(logits.astype(np.float64))[np.arange(B)[:, None], np.arange(T), tokens]
           + rng.normal(scale=0.3, size=(B, T)))
    ref = old + rng.normal(scale=0.3, size=(B, T))
    adv = rng.normal(size=(B, T))
    spec = loss_specs(loss_agg_mode=agg, entropy_coeff=0.05, use_kl_loss=True, kl_loss_coef=0.2,
                      clip_ratio_low=0.1, clip_ratio_high=0.1)[0]
    m = TrainBatch(old_log_probs=jnp.asarray(old, jnp.float32), ref_log_probs=jnp.asarray(ref, jnp.float32),
                   advantages=jnp.asarray(adv * trained, jnp.float32))
    mask = jnp.asarray(trained)
    den, den_plain = actor_denominators(spec, mask)

    def loss_of(z):
        logp_all = jax.nn.log_softmax(z, axis=-1)
        logp = jnp.take_along_axis(logp_all, jnp.asarray(tokens)[..., None], axis=-1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return actor_loss(spec, logp, ent, m, mask, den, den_plain, None)

    (loss, aux), grad = jax.value_and_grad(loss_of, has_aux=True)(jnp.asarray(logits))
    grad = np.asarray(grad)
    holes = (valid > 0) & (trained == 0)
    assert holes.any() and np.all(grad[holes] == 0.0)  # exactly zero at tool positions
    assert np.abs(grad[trained > 0]).sum() > 0

    # float64 reference: every mean over trained tokens only
    lp_all = _np_log_softmax(logits.astype(np.float64))
    logp = lp_all[np.arange(B)[:, None], np.arange(T), tokens]
    ent = -(np.exp(lp_all) * lp_all).sum(-1)
    ratio = np.exp(logp - old)
    a = adv * trained
    lc = np.maximum(-a * ratio, -a * np.clip(ratio, 0.9, 1.1))
    pg = np.where(a < 0, np.minimum(-a * 3.0, lc), lc)
    x = ref - logp
    kl = np.clip(np.exp(x) - x - 1, -10, 10)

    def mean(v):
        if agg == "token-mean":
            return (v * trained).sum() / trained.sum()
        rows = trained.sum(1) > 0
        return ((v * trained).sum(1)[rows] / trained.sum(1)[rows]).mean()

    expect = mean(pg) - 0.05 * mean(ent) + 0.2 * mean(kl)
    assert float(loss) == pytest.approx(expect, rel=1e-5)
    assert float(aux["actor/entropy"]) == pytest.approx(mean(ent), rel=1e-5)
    assert float(aux["actor/kl_loss"]) == pytest.approx(mean(kl), rel=1e-5)


def test_group_advantages_are_per_trajectory():
    """GRPO: the score sits on the trajectory's last trained token; every trained token of a trajectory gets the
    trajectory's normalised score, tool tokens get 0."""
    rng = np.random.default_rng(1)
    B, T, n = 8, 10, 4
    valid = (np.arange(T)[None, :] < rng.integers(6, T + 1, B)[:, None]).astype(np.float32)
    trained = valid.copy()
    trained[:, 2:5] = 0
    trained[1, 5:] = 0  # ends with a tool response: the score goes to the last trained token
    scores = rng.normal(size=B).astype(np.float32)
    token_scores = place_on_last_token(jnp.asarray(scores), jnp.asarray(trained))
    assert np.asarray(token_scores)[1, 1] == scores[1]
    groups = jnp.asarray(np.repeat(np.arange(B // n), n), jnp.int32)
    adv, _ = algos.compute_advantages("grpo", token_level_rewards=token_scores, response_mask=jnp.asarray(trained),
                                      group_ids=groups, norm_adv_by_std_in_grpo=True)
    g = scores.astype(np.float64).reshape(-1, n)
    expect = ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-6)).ravel()
    np.testing.assert_allclose(np.asarray(adv), expect[:, None] * trained, rtol=1e-5, atol=1e-6)


def test_rollout_batch_attention_covers_tool_tokens():
    trained = jnp.asarray([[1, 1, 0, 0, 1, 0]], jnp.int32)
    valid = jnp.asarray([[1, 1, 1, 1, 1, 0]], jnp.int32)
    z = jnp.zeros((1, 6), jnp.int32)
    single = RolloutBatch(z[:, :2], z[:, :2] + 1, z, trained, z.astype(jnp.float32), jnp.zeros((1,), bool))
    assert (single.attention_mask()[0, 2:] == trained[0]).all()  # single-turn: the response mask
    multi = single.replace(response_valid=valid)
    assert (multi.attention_mask()[0, 2:] == valid[0]).all() and int(multi.response_lengths()[0]) == 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rlhf_jax.parallel import make_mesh
    from tests.conftest import build_hf_checkpoint

    path = str(tmp_path_factory.mktemp("holes") / "llama")
    build_hf_checkpoint("llama", path)
    return path, make_mesh(2, 2, 2), with_holes(ragged_batch(0, vocab=128), seed=2)


def _padded(mesh, host) -> TrainBatch:
    g = lambda x: to_global(mesh, x)  # noqa: E731
    return TrainBatch(input_ids=g(np.concatenate([host["prompts"], host["responses"]], 1)),
                      attention_mask=g(np.concatenate([host["prompt_mask"], host["response_valid"]], 1)),
                      responses=g(host["responses"]), response_mask=g(host["response_mask"]))


def _packed(mesh, host) -> list[dict]:  # laid out by the valid tokens, as the trainer packs
    return _micros(mesh, {**host, "response_mask": host["response_valid"]})


def test_old_log_probs_on_sequences_with_holes_packed_equal_padded(setup):
    path, mesh, host = setup
    actor = _role(path, mesh)
    padded = np.asarray(actor.log_probs(_padded(mesh, host), n_micro=2, temperature=0.7))
    packed = np.asarray(actor.log_probs_packed(_packed(mesh, host), (N, R), dp=DP, temperature=0.7))
    valid = host["response_valid"].astype(bool)
    np.testing.assert_allclose(packed[valid], padded[valid], atol=1e-5)
    # the trained tokens after a tool response read it: with the tool tokens hidden their log-probs change
    hidden = actor.log_probs(_padded(mesh, host).replace(attention_mask=to_global(
        mesh, np.concatenate([host["prompt_mask"], host["response_mask"]], 1))), n_micro=2, temperature=0.7)
    after_tool = (host["response_mask"] > 0) & (np.cumsum(valid & (host["response_mask"] == 0), 1) > 0)
    assert after_tool.any() and not np.allclose(np.asarray(hidden)[after_tool], padded[after_tool], atol=1e-4)


def test_actor_update_with_holes_packed_equals_padded(setup):
    path, mesh, host = setup
    g = lambda x: to_global(mesh, x)  # noqa: E731
    spec = loss_specs(loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.04, entropy_coeff=0.01,
                      temperature=0.7, clip_ratio_low=0.05, clip_ratio_high=0.05)[0]
    key = jax.random.key(3)
    results = []
    for packed in (False, True):
        role = _role(path, mesh)
        before = jax.tree.map(np.asarray, role.params)
        logp = role.log_probs(_padded(mesh, host), n_micro=1, temperature=0.7)
        grid = TrainBatch(response_mask=g(host["response_mask"]), advantages=g(host["advantages"]),
                          old_log_probs=logp + g(host["noise"]) * g(host["response_mask"]),
                          ref_log_probs=logp - g(host["noise"]) * g(host["response_mask"]))
        if packed:
            metrics = role.update_packed(losses.actor(spec), _packed(mesh, host), grid, dp=DP, rng=key)
        else:
            p = _padded(mesh, host)
            mb = grid.replace(input_ids=p.input_ids, attention_mask=p.attention_mask, responses=p.responses)
            metrics = role.update(losses.actor(spec), mb, n_micro=2, rng=key)
        grads = jax.tree.map(lambda b, a: b - np.asarray(a), before, role.params)
        results.append(({k: float(v) for k, v in metrics.items()}, grads, role.params))
    (m_pad, g_pad, _), (m_packed, g_packed, params) = results
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        assert m_packed[k] == pytest.approx(m_pad[k], rel=1e-5, abs=1e-7), k
    assert_grads_close(g_pad, g_packed, params)
