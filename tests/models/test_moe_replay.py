"""Routing replay at the model level (models/moe.py): a pass that replays the expert ids another pass recorded
reproduces that pass exactly; forcing other ids changes the logits; the replayed gate weights are the current
router probabilities at the forced ids (checked against a float64 NumPy restatement of verl's replay rule)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.models import from_pretrained
from rlhf_jax.models.moe import route
from tests.conftest import left_padded_batch

LENGTHS = [11, 7, 4]


def _run(model, ids, mask, routes=None, record=False):
    @jax.jit
    def fwd(m, i, a, r):
        out = m.hidden_states(i, a, routes=r, record_routes=record)
        hidden, recorded = out if record else (out, None)
        return m.logits_from_hidden(hidden), recorded
    return fwd(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32), routes)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("remat", ["none", "full"])
def test_replaying_recorded_routes_reproduces_the_pass(hf_checkpoint, kind, remat):
    path, _ = hf_checkpoint(kind)
    model = from_pretrained(path, remat=remat)
    cfg = model.config
    ids, mask = left_padded_batch(np.random.default_rng(3), 128, LENGTHS)
    logits, routes = _run(model, ids, mask, record=True)
    assert routes.shape == (len(LENGTHS), ids.shape[1], sum(cfg.sparse_layers), cfg.num_experts_per_tok)
    assert routes.dtype == jnp.int32 and int(routes.min()) >= 0 and int(routes.max()) < cfg.num_experts
    plain, _ = _run(model, ids, mask)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(logits))  # recording changes nothing
    replayed, again = _run(model, ids, mask, routes=routes, record=True)
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(routes))
    # every real token of the last sparse layer routed to other experts: its logits change, earlier tokens' not
    other = np.asarray(routes).copy()
    other[:, -1, -1] = (other[:, -1, -1] + 1) % cfg.num_experts
    forced, used = _run(model, ids, mask, routes=jnp.asarray(other), record=True)
    np.testing.assert_array_equal(np.asarray(used), other)
    diff = np.abs(np.asarray(forced) - np.asarray(logits)).max(-1)
    assert diff[:, -1].min() > 1e-4 and diff[:, :-1].max() == 0.0
    # -1 rows route natively
    none = jnp.full_like(routes, -1)
    native, _ = _run(model, ids, mask, routes=none)
    np.testing.assert_array_equal(np.asarray(native), np.asarray(logits))


@pytest.mark.parametrize("norm", [True, False])
def test_replayed_gate_weights_are_current_probabilities_at_forced_ids(norm):
    rng = np.random.default_rng(7)
    N, X, K = 6, 8, 2
    logits = rng.normal(size=(N, X))
    forced = np.stack([rng.choice(X, K, replace=False) for _ in range(N)])
    forced[2] = -1  # no record: top-k
    _, weights, ids = route(jnp.asarray(logits, jnp.float32), K, norm, jnp.asarray(forced, jnp.int32))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want_ids = forced.copy()
    want_ids[2] = np.argsort(-p[2])[:K]
    want = np.take_along_axis(p, want_ids, -1)
    if norm:
        want = want / want.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-6, atol=1e-7)
