"""Programs shared by owners described alike (rlhf_jax/runtime/programs.py).

Two training roles of equally built models, equal optimizer settings and one mesh run one program for each pass and
each learns what it would alone; a role that differs in anything a program is built from (the optimizer's settings,
the parameters' layout) gets programs of its own. Two samplers of one model share their rollout program.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax import models
from rlhf_jax.parallel import make_mesh
from rlhf_jax.runtime import programs
from rlhf_jax.train import losses
from rlhf_jax.train.engine import Role
from rlhf_jax.train.optim import make_optimizer
from tests.train.helpers import loss_specs
from tests.train.test_packing import DP, _micros, _padded, ragged_batch


def _optim(lr: float, **changes) -> types.SimpleNamespace:
    settings = dict(optimizer="AdamW", lr=lr, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.0, warmup_style="constant",
                    min_lr_ratio=0.0, num_cycles=0.5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                    override_optimizer_config={})
    return types.SimpleNamespace(**{**settings, **changes})


def test_equal_optimizer_settings_give_the_same_transformation_and_any_change_another():
    tx, schedule = make_optimizer(_optim(1e-3), 1.0, 10, 2)
    assert make_optimizer(_optim(1e-3), 1.0, 10, 2) == (tx, schedule)
    for other in (make_optimizer(_optim(2e-3), 1.0, 10, 2), make_optimizer(_optim(1e-3, eps=1e-6), 1.0, 10, 2),
                  make_optimizer(_optim(1e-3), 0.5, 10, 2), make_optimizer(_optim(1e-3), 1.0, 20, 2),
                  make_optimizer(_optim(1e-3, optimizer="Adafactor"), 1.0, 10, 2)):
        assert other[0] is not tx


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    from tests.conftest import build_hf_checkpoint

    path = str(tmp_path_factory.mktemp("programs") / "llama")
    build_hf_checkpoint("llama", path)
    return path, make_mesh(2, 2, 2), ragged_batch(3, vocab=128)


def _role(setting, lr: float, mesh=None) -> Role:
    path, default_mesh, _ = setting
    mesh = mesh or default_mesh
    tx, lr_fn = make_optimizer(_optim(lr), 1.0, 10, 1)
    return Role(models.from_pretrained(path, mesh=mesh, param_dtype=jnp.float32), mesh, tx, lr_fn)


def _train(role: Role, setting, mesh=None) -> list[float]:
    """Two padded and two packed actor updates; the gradient norms."""
    mesh = mesh or setting[1]
    host = setting[2]
    from rlhf_jax.parallel.hosts import to_global
    from rlhf_jax.types import TrainBatch

    g = lambda x: to_global(mesh, x)  # noqa: E731
    actor_spec, _ = loss_specs(temperature=0.7)
    loss = losses.actor(actor_spec)
    mask = g(host["response_mask"])
    grid = TrainBatch(response_mask=mask, advantages=g(host["advantages"]), old_log_probs=-5.0 * mask,
                      ref_log_probs=-5.0 * mask)
    norms = []
    for i in range(2):
        p = _padded(mesh, host)
        mb = grid.replace(input_ids=p.input_ids, attention_mask=p.attention_mask, responses=p.responses)
        norms.append(float(role.update(loss, mb, n_micro=2, rng=jax.random.key(i))["actor/grad_norm"]))
    for i in range(2):
        metrics = role.update_packed(loss, _micros(mesh, host), grid, dp=DP, rng=jax.random.key(i))
        norms.append(float(metrics["actor/grad_norm"]))
    return norms


def _leaves(role: Role) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(role.params)]


def test_roles_described_alike_share_programs_and_each_learns_what_it_would_alone(setting):
    programs.clear()
    first = _role(setting, 1e-2)
    first_norms = _train(first, setting)
    again = _role(setting, 1e-2)
    again_norms = _train(again, setting)
    assert again._compiled.keys() == first._compiled.keys()
    assert all(again._compiled[k] is first._compiled[k] for k in first._compiled)  # the same programs
    assert again_norms == first_norms
    for a, b in zip(_leaves(again), _leaves(first)):
        np.testing.assert_array_equal(a, b)

    # Another learning rate: the update programs are its own, and it learns differently. The forward and gradient
    # passes do not read the optimizer: those it shares.
    other = _role(setting, 5e-2)
    other_norms = _train(other, setting)
    own = {k for k in first._compiled if other._compiled[k] is not first._compiled[k]}
    assert own and own < set(first._compiled), own
    assert other_norms[:1] == first_norms[:1] and other_norms[1:] != first_norms[1:]
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(other), _leaves(first)))

    # Another layout of the same parameters: nothing is shared.
    mesh = make_mesh(1, 4, 2)
    moved = _role(setting, 1e-2, mesh)
    _train(moved, setting, mesh)
    assert not any(moved._compiled[k] is first._compiled.get(k) for k in moved._compiled)
    programs.clear()


def test_samplers_of_one_model_share_their_rollout_program(setting):
    from flax import nnx

    from rlhf_jax.rollout.params import SamplingParams
    from rlhf_jax.rollout.sampler import Sampler

    programs.clear()
    path, mesh, _ = setting
    params = SamplingParams(max_new_tokens=4, n=2)
    built = []
    for _ in range(2):
        graphdef, state = nnx.split(models.from_pretrained(path, mesh=mesh))
        sampler = Sampler(graphdef)
        built.append((sampler, sampler.compiled(state, 8, 8, params)))
    (first, program), (second, same) = built
    assert same is program
    assert (first.compile_count, first.trace_count) == (1, 1) and (second.compile_count, second.trace_count) == (1, 0)
    assert Sampler(graphdef).compiled(state, 8, 8, params.replace(max_new_tokens=5)) is not program
    programs.clear()
