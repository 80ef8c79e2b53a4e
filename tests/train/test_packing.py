"""Packed training passes equal the padded ones: per-token log-probs, values, losses, gradients, a GRPO step.

The batch is ragged (left-padded prompts of 2..12 tokens, responses of 1..10 tokens) and
packed several sequences per row on a (data=2, fsdp=2, tensor=2) mesh. An SGD step with
learning rate 1 makes ``params_before - params_after`` the mini-batch gradient itself, so
comparing updated parameters compares gradients.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlhf_jax import models
from rlhf_jax.batch import first_fit_decreasing, micro_layout, pack_batch, row_buckets
from rlhf_jax.batch.packing import BRANCH_BITS, MAX_BRANCHES, logit_list_size
from rlhf_jax.parallel import make_mesh
from rlhf_jax.parallel.hosts import to_global
from rlhf_jax.train import losses
from rlhf_jax.train.engine import Role
from rlhf_jax.train.steps import ActorLossSpec
from rlhf_jax.types import TrainBatch
from tests.train.helpers import loss_specs

N, P, R, DP = 16, 12, 10, 4


def ragged_batch(seed: int, vocab: int) -> dict[str, np.ndarray]:
    """Left-padded prompts of 2..12 tokens (rows 2j and 2j + 1 share one in the first half of every shard, as
    the samples of one prompt do), right-padded responses of 1..10 tokens."""
    rng = np.random.default_rng(seed)
    prompts = np.zeros((N, P), np.int32)
    prompt_mask = np.zeros((N, P), np.int32)
    responses = np.zeros((N, R), np.int32)
    response_mask = np.zeros((N, R), np.int32)
    for i in range(N):
        if i % (N // DP) >= N // DP // 2 or i % 2 == 0:
            p = rng.integers(2, P + 1)
            prompt = rng.integers(1, vocab, p)
        r = rng.integers(1, R + 1)
        prompts[i, P - p:] = prompt
        prompt_mask[i, P - p:] = 1
        responses[i, :r] = rng.integers(1, vocab, r)
        response_mask[i, :r] = 1
    return {"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses, "response_mask": response_mask,
            "advantages": rng.normal(size=(N, R)).astype(np.float32) * response_mask,
            "returns": rng.normal(size=(N, R)).astype(np.float32) * response_mask,
            "noise": rng.normal(scale=0.1, size=(N, R)).astype(np.float32)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.conftest import build_hf_checkpoint

    path = str(tmp_path_factory.mktemp("packing") / "llama")
    build_hf_checkpoint("llama", path)
    mesh = make_mesh(2, 2, 2)
    host = ragged_batch(0, vocab=128)
    return path, mesh, host


def _role(path, mesh, task=None, attn="auto", dtype=jnp.float32):
    model = models.from_pretrained(path, mesh=mesh, task=task, attn_impl=attn, dtype=dtype, param_dtype=jnp.float32)
    return Role(model, mesh, optax.sgd(1.0), lambda step: 1.0)


def _padded(mesh, host) -> TrainBatch:
    g = lambda x: to_global(mesh, x)  # noqa: E731
    return TrainBatch(input_ids=g(np.concatenate([host["prompts"], host["responses"]], 1)),
                      attention_mask=g(np.concatenate([host["prompt_mask"], host["response_mask"]], 1)),
                      responses=g(host["responses"]), response_mask=g(host["response_mask"]))


def _micros(mesh, host, rows=None, row_len=32, rows_per_micro=1) -> list[dict]:
    if rows is not None:
        host = {k: v[rows] for k, v in host.items()}
    packed = pack_batch(host["prompts"], host["prompt_mask"], host["responses"], host["response_mask"],
                        dp=DP, row_len=row_len, max_rows_per_micro=rows_per_micro)
    assert packed.num_micro >= 2  # gradient accumulation over several packed micro-batches
    assert ((packed.segment_ids >> BRANCH_BITS).max(axis=-1) >= 2).any()  # several prompts share a row
    assert ((packed.segment_ids & MAX_BRANCHES) >= 2).any()  # two responses share a prompt
    return [{k: to_global(mesh, v) for k, v in packed.micro(i).items()} for i in range(packed.num_micro)]


@pytest.mark.parametrize("share", [True, False])
def test_pack_layout_puts_every_token_where_its_target_says(share):
    host = ragged_batch(1, vocab=50)
    packed = pack_batch(host["prompts"], host["prompt_mask"], host["responses"], host["response_mask"],
                        dp=DP, row_len=24, max_rows_per_micro=2, share_prompts=share)
    per_shard, rows, L = N // DP, 2, 24
    filled = np.zeros((N, R), int)
    for m in range(packed.num_micro):
        ids, pos, seg = (a[m].reshape(DP, rows * L) for a in (packed.input_ids, packed.positions, packed.segment_ids))
        where, cells, tokens = (a[m].reshape(DP, -1) for a in (packed.logit_positions, packed.logit_targets,
                                                               packed.logit_token_ids))
        assert where.shape[1] % (rows * L // 16) == 0
        for shard in range(DP):
            for at, cell, token in zip(where[shard], cells[shard], tokens[shard]):
                if cell < 0:
                    continue
                local, t = divmod(int(cell), R)
                i = shard * per_shard + local
                p = host["prompt_mask"][i].sum()
                assert token == host["responses"][i, t]
                assert pos[shard, at] == p - 1 + t  # the state predicting token t sits at position p - 1 + t
                if t == 0:  # the prompt's last token, in a prompt segment
                    assert ids[shard, at] == host["prompts"][i, -1] and seg[shard, at] & MAX_BRANCHES == 0
                else:  # the response's previous token, in a response segment of the same unit
                    assert ids[shard, at] == host["responses"][i, t - 1] and seg[shard, at] & MAX_BRANCHES > 0
                filled[i, t] += 1
    np.testing.assert_array_equal(filled, host["response_mask"])  # every response token exactly once
    assert packed.real_tokens == int(host["prompt_mask"].sum() + host["response_mask"].sum())
    shared = int(host["prompt_mask"][0::2][:: 2].sum())  # a prompt per shared pair is laid once
    assert packed.placed_tokens == packed.real_tokens - (shared if share else 0)


@pytest.mark.parametrize("share", [True, False])
def test_routes_travel_between_the_sequence_grid_and_the_packed_rows(share):
    """``route_sources`` name the (N, P + R) grid cell of each packed position: per-token expert ids gathered
    through them (checked against a NumPy gather) and scattered back, shared prompts copied through
    ``prompt_rows``, give back every real cell and -1 elsewhere."""
    from rlhf_jax.train.packed_steps import gather_routes, scatter_routes, share_prompt_routes

    host = ragged_batch(2, vocab=50)
    packed = pack_batch(host["prompts"], host["prompt_mask"], host["responses"], host["response_mask"],
                        dp=DP, row_len=24, max_rows_per_micro=2, share_prompts=share)
    T, per_shard, S, K = P + R, N // DP, 2, 3
    grid_ids = np.concatenate([host["prompts"], host["responses"]], 1)
    real = np.concatenate([host["prompt_mask"], host["response_mask"]], 1).astype(bool)
    routes = np.random.default_rng(3).integers(0, 8, (N, T, S, K)).astype(np.int32)
    for i in range(N):  # equal prompts were routed alike (the sampler computes a prompt once for its samples)
        same = [j for j in range(i - i % per_shard, i) if (grid_ids[j, :P] == grid_ids[i, :P]).all()]
        routes[i, :P] = routes[same[0], :P] if same else routes[i, :P]
    routes[~real] = -1
    for i in range(N):
        assert (grid_ids[i, :P] == grid_ids[(i // per_shard) * per_shard + packed.prompt_rows[i], :P]).all()
    written = jnp.full_like(routes, -1)
    for m in range(packed.num_micro):
        sources, ids = packed.route_sources[m].reshape(DP, -1), packed.input_ids[m].reshape(DP, -1)
        got = gather_routes(jnp.asarray(routes), jnp.asarray(packed.route_sources[m]), DP)
        flat = np.asarray(got).reshape(DP, -1, S, K)
        for shard in range(DP):
            for at, cell in enumerate(sources[shard]):
                if cell < 0:
                    assert (flat[shard, at] == -1).all()
                    continue
                i, col = shard * per_shard + cell // T, cell % T
                assert real[i, col] and ids[shard, at] == grid_ids[i, col]
                np.testing.assert_array_equal(flat[shard, at], routes[i, col])
        written = scatter_routes(got, jnp.asarray(packed.route_sources[m]), written, DP)
    written = share_prompt_routes(written, jnp.asarray(packed.prompt_rows), P, DP)
    np.testing.assert_array_equal(np.asarray(written), routes)


def test_micro_layout_uses_few_shapes_and_little_padding():
    assert row_buckets(16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert row_buckets(20) == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    assert micro_layout(22, 16) == (2, 12)  # 24 rows computed for 22 needed, not 2 x 16
    assert micro_layout(5, 48) == (1, 6)
    assert micro_layout(1, 1) == (1, 1)
    for needed in range(1, 200):
        n, per = micro_layout(needed, 16)
        assert per <= 16 and n * per >= needed and n == -(-needed // 16)
        assert n * per <= 1.5 * needed + 1  # padding rows stay below a third (+1 for tiny counts)


def test_logit_list_sizes_are_few_and_mostly_full():
    cells = 2 * 256
    sizes = {logit_list_size(count, cells) for count in range(1, cells + 1)}
    assert sizes == {32 * b for b in (1, 2, 3, 4, 6, 8, 12, 16)}
    for count in range(1, cells + 1):
        size = logit_list_size(count, cells)
        assert count <= size <= max(64, 1.5 * count)


def test_first_fit_decreasing_respects_capacity():
    lengths = np.random.default_rng(2).integers(1, 30, size=200)
    bins = first_fit_decreasing(lengths, 32)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 32 for b in bins)
    assert len(bins) <= int(np.ceil(lengths.sum() / 32 * 11 / 9)) + 1  # FFD's 11/9 OPT + 1 bound


@pytest.mark.parametrize("attn", ["dense", "blockwise"])
def test_packed_log_probs_and_values_equal_padded(setup, attn):
    path, mesh, host = setup
    actor = _role(path, mesh, attn=attn)
    padded = actor.log_probs(_padded(mesh, host), n_micro=2, temperature=0.7)
    packed = actor.log_probs_packed(_micros(mesh, host), (N, R), dp=DP, temperature=0.7)
    mask = host["response_mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(packed)[mask], np.asarray(padded)[mask], atol=1e-5)
    assert np.all(np.asarray(packed)[~mask] == 0)

    critic = _role(path, mesh, task=models.TASK_TOKEN_VALUE, attn=attn)
    v_pad = critic.values(_padded(mesh, host), n_micro=1)
    v_packed = critic.values_packed(_micros(mesh, host), (N, R), dp=DP)
    np.testing.assert_allclose(np.asarray(v_packed)[mask], np.asarray(v_pad)[mask], atol=1e-5)


def assert_grads_close(g_pad, g_packed, params):
    """Relative 1e-5 on each gradient, plus the float32 rounding of reading it back as before - after."""
    for (path_, a), b, p in zip(jax.tree.leaves_with_path(g_pad), jax.tree.leaves(g_packed), jax.tree.leaves(params)):
        tol = 1e-5 * max(np.abs(a).max(), 1e-12) + 2 * np.finfo(np.float32).eps * np.abs(np.asarray(p)).max()
        assert np.abs(a - b).max() <= tol, jax.tree_util.keystr(path_)


def _grad_step(role, spec, mesh, host, packed: bool, key):
    g = lambda x: to_global(mesh, x)  # noqa: E731
    before = jax.tree.map(np.asarray, role.params)
    mask = g(host["response_mask"])
    grid = TrainBatch(response_mask=mask, advantages=g(host["advantages"]))
    if isinstance(spec, ActorLossSpec):
        loss = losses.actor(spec)
        logp = role.log_probs(_padded(mesh, host), n_micro=1, temperature=spec.temperature)
        grid = grid.replace(old_log_probs=logp + g(host["noise"]) * mask,  # ratios away from 1: clipping active
                            ref_log_probs=logp - g(host["noise"]) * mask)
    else:
        loss = losses.critic(spec)
        grid = grid.replace(values=g(host["noise"]), returns=g(host["returns"]))
    if packed:
        metrics = role.update_packed(loss, _micros(mesh, host), grid, dp=DP, rng=key)
    else:
        p = _padded(mesh, host)
        mb = grid.replace(input_ids=p.input_ids, attention_mask=p.attention_mask, responses=p.responses)
        metrics = role.update(loss, mb, n_micro=2, rng=key)
    grads = jax.tree.map(lambda b, a: b - np.asarray(a), before, role.params)
    return {k: float(v) for k, v in metrics.items()}, grads


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_actor_loss_and_gradients_equal_padded(setup, agg):
    path, mesh, host = setup
    spec = loss_specs(loss_agg_mode=agg, use_kl_loss=True, kl_loss_coef=0.04, kl_loss_type="low_var_kl",
                      entropy_coeff=0.01, temperature=0.7, norm_constant=float(R), clip_ratio_low=0.05,
                         clip_ratio_high=0.05)[0]
    key = jax.random.key(3)
    m_pad, g_pad = _grad_step(_role(path, mesh), spec, mesh, host, False, key)
    role = _role(path, mesh)
    m_packed, g_packed = _grad_step(role, spec, mesh, host, True, key)
    assert m_pad["actor/pg_clipfrac"] > 0  # the clipped branch is exercised
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert m_packed[k] == pytest.approx(m_pad[k], rel=1e-5, abs=1e-7), k
    assert_grads_close(g_pad, g_packed, role.params)


def test_packed_critic_loss_and_gradients_equal_padded(setup):
    path, mesh, host = setup
    spec = dataclasses.replace(loss_specs()[1], cliprange_value=0.05, loss_agg_mode="token-mean")
    m_pad, g_pad = _grad_step(_role(path, mesh, task=models.TASK_TOKEN_VALUE), spec, mesh, host, False, None)
    role = _role(path, mesh, task=models.TASK_TOKEN_VALUE)
    m_packed, g_packed = _grad_step(role, spec, mesh, host, True, None)
    for k in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"):
        assert m_packed[k] == pytest.approx(m_pad[k], rel=1e-5, abs=1e-7), k
    assert_grads_close(g_pad, g_packed, role.params)


def test_gspo_sequence_ratio_packed_equals_padded(setup):
    """A sequence-level policy loss (GSPO's per-sequence ratio) sees whole sequences in the grid."""
    path, mesh, host = setup
    spec = loss_specs(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean", temperature=1.0)[0]
    key = jax.random.key(4)
    m_pad, g_pad = _grad_step(_role(path, mesh), spec, mesh, host, False, key)
    role = _role(path, mesh)
    m_packed, g_packed = _grad_step(role, spec, mesh, host, True, key)
    assert m_packed["actor/pg_loss"] == pytest.approx(m_pad["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert_grads_close(g_pad, g_packed, role.params)


def test_bfloat16_compute_with_float32_master_weights_matches_float32(setup):
    """compute_dtype=bfloat16 keeps float32 parameters (so float32 optimizer state and updates); the loss and the
    gradient agree with float32 compute within bfloat16 precision (8-bit mantissa, 2 layers)."""
    path, mesh, host = setup
    spec = loss_specs(use_kl_loss=True, kl_loss_coef=0.04, temperature=1.0)[0]
    key = jax.random.key(5)
    m32, g32 = _grad_step(_role(path, mesh), spec, mesh, host, True, key)
    role16 = _role(path, mesh, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(role16.params))
    m16, g16 = _grad_step(role16, spec, mesh, host, True, key)
    for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        assert m16[k] == pytest.approx(m32[k], rel=3e-2, abs=1e-3), k
    flat32 = np.concatenate([x.ravel() for x in jax.tree.leaves(g32)])
    flat16 = np.concatenate([x.ravel() for x in jax.tree.leaves(g16)])
    cosine = flat32 @ flat16 / (np.linalg.norm(flat32) * np.linalg.norm(flat16))
    assert cosine > 0.99, cosine
