"""The reference model's parameters in host memory (``actor_rollout_ref.ref.fsdp_config.param_offload``).

An offloaded role keeps its parameters in ``pinned_host`` memory and copies them to the devices inside each
forward program: the log-probs (padded and packed) equal those of the same role in device memory, bit for bit,
on a (data=2, fsdp=2, tensor=2) mesh, and the memory plan counts no device bytes for the parameters.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from rlhf_jax import models
from rlhf_jax.parallel import make_mesh
from rlhf_jax.train.engine import HOST_MEMORY, Role
from rlhf_jax.train.passes import per_device_bytes
from tests.train.test_packing import DP, N, R, _micros, _padded, ragged_batch


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


def test_a_role_with_an_optimizer_cannot_be_offloaded(roles):
    mesh, on_device, _ = roles
    with pytest.raises(ValueError, match="without an optimizer"):
        Role(on_device.model(), mesh, optax.sgd(1.0), offload=True)
