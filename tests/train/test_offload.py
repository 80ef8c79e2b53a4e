"""Parameters and optimizer state in host memory (``*.fsdp_config.param_offload`` / ``optimizer_offload``).

An offloaded role keeps its arrays in ``pinned_host`` memory and copies them to the devices inside each program: the
reference's log-probs (padded and packed) equal those of the same role in device memory, bit for bit, on a
(data=2, fsdp=2, tensor=2) mesh, and the memory plan counts no device bytes for them. A trained role (actor, critic)
with offloaded parameters and optimizer state takes the same AdamW steps, padded and packed, bit for bit, and its
updated arrays are back in host memory after each.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import jax.numpy as jnp

from rlhf_jax import models
from rlhf_jax.parallel import make_mesh
from rlhf_jax.train.engine import HOST_MEMORY, Role
from rlhf_jax.train.passes import per_device_bytes
from tests.train.test_packing import DP, N, R, _micros, _padded, ragged_batch
from tests.train.helpers import loss_specs


@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    from tests.conftest import build_hf_checkpoint

    path = str(tmp_path_factory.mktemp("offload") / "llama")
    build_hf_checkpoint("llama", path)
    mesh = make_mesh(2, 2, 2)
    load = lambda: models.from_pretrained(path, mesh=mesh)  # noqa: E731
    return mesh, Role(load(), mesh), Role(load(), mesh, offload=True)


def test_parameters_live_in_host_memory_and_hold_no_device_bytes(roles):
    _, on_device, offloaded = roles
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(offloaded.state())}
    assert kinds == {HOST_MEMORY}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(on_device.state())} == {"device"}
    assert per_device_bytes(offloaded.state()) == 0 < per_device_bytes(on_device.state())


def test_log_probs_equal_the_role_in_device_memory(roles):
    mesh, on_device, offloaded = roles
    host = ragged_batch(3, vocab=128)
    batch = _padded(mesh, host)
    for with_entropy in (False, True):
        want = on_device.log_probs(batch, n_micro=2, temperature=0.7, with_entropy=with_entropy)
        got = offloaded.log_probs(batch, n_micro=2, temperature=0.7, with_entropy=with_entropy)
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    micros = _micros(mesh, host)
    want = on_device.log_probs_packed(micros, (N, R), dp=DP, temperature=0.7)
    got = offloaded.log_probs_packed(micros, (N, R), dp=DP, temperature=0.7)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the parameters are still in host memory after the passes
    assert {x.sharding.memory_kind for x in jax.tree.leaves(offloaded.state())} == {HOST_MEMORY}


def _trained(path, mesh, task=None, **offload):
    model = models.from_pretrained(path, mesh=mesh, task=task, param_dtype=jnp.float32)
    return Role(model, mesh, optax.adamw(1e-2, weight_decay=0.01), lambda step: 1e-2, **offload)


def _kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _steps(role, critic: bool, mesh, host, packed: bool) -> list[dict]:
    """Three optimizer steps of the actor's (or the critic's) loss, padded or packed; their metrics."""
    from rlhf_jax.parallel.hosts import to_global
    from rlhf_jax.train import losses
    from rlhf_jax.types import TrainBatch

    g = lambda x: to_global(mesh, x)  # noqa: E731
    actor_spec, critic_spec = loss_specs(use_kl_loss=True, kl_loss_coef=0.04, temperature=0.7,
                                         clip_ratio_low=0.05, clip_ratio_high=0.05)
    mask = g(host["response_mask"])
    grid = TrainBatch(response_mask=mask, advantages=g(host["advantages"]), values=g(host["noise"]),
                      returns=g(host["returns"]), old_log_probs=g(host["noise"]) * mask - 5.0 * mask,
                      ref_log_probs=-g(host["noise"]) * mask - 5.0 * mask)
    loss = losses.critic(critic_spec) if critic else losses.actor(actor_spec)
    out = []
    for i in range(3):
        key = None if critic else jax.random.key(i)
        if packed:
            metrics = role.update_packed(loss, _micros(mesh, host), grid, dp=DP, rng=key)
        else:
            p = _padded(mesh, host)
            mb = grid.replace(input_ids=p.input_ids, attention_mask=p.attention_mask, responses=p.responses)
            metrics = role.update(loss, mb, n_micro=2, rng=key)
        out.append({k: float(v) for k, v in metrics.items()})
    return out


@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_offloaded_parameters_and_optimizer_state_train_bit_for_bit(roles, tmp_path, packed, critic):
    from tests.conftest import build_hf_checkpoint

    mesh = roles[0]
    path = str(tmp_path / "llama")
    build_hf_checkpoint("llama", path)
    host = ragged_batch(5, vocab=128)
    task = models.TASK_TOKEN_VALUE if critic else None
    on_device = _trained(path, mesh, task)
    offloaded = _trained(path, mesh, task, offload=True, offload_optimizer=True)
    assert _kinds(offloaded.params) == _kinds(offloaded.opt_state) == {HOST_MEMORY}
    assert per_device_bytes([offloaded.params, offloaded.opt_state]) == 0
    want = _steps(on_device, critic, mesh, host, packed)
    got = _steps(offloaded, critic, mesh, host, packed)
    assert got == want
    assert offloaded.update_count() == on_device.update_count() == 3
    # the updated arrays went back to host memory, and equal the ones updated in device memory
    assert _kinds(offloaded.params) == _kinds(offloaded.opt_state) == {HOST_MEMORY}
    for a, b in zip(jax.tree.leaves((on_device.params, on_device.opt_state)),
                    jax.tree.leaves((offloaded.params, offloaded.opt_state))):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    assert _kinds(offloaded.device_state()) == {"device"}


def test_optimizer_state_alone_can_be_offloaded(roles):
    mesh, on_device, _ = roles
    role = Role(on_device.model(), mesh, optax.adam(1e-3), offload_optimizer=True)
    assert _kinds(role.params) == {"device"} and _kinds(role.opt_state) == {HOST_MEMORY}
