"""Parameter shardings from the ``logical_axes`` metadata each ``nnx.Param`` carries."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rlhf_jax.parallel.mesh import DEFAULT_RULES, Rules, named_sharding


def variable_sharding(var: nnx.Variable, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    axes = var.get_metadata().get("logical_axes") or (None,) * len(var.get_value().shape)
    return named_sharding(mesh, axes, var.get_value().shape, rules)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """A pytree matching ``state`` (arrays or ShapeDtypeStructs) whose leaves are NamedShardings."""
    return jax.tree.map(
        lambda v: variable_sharding(v, mesh, rules), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """Move a model's parameters into their sharded layout on ``mesh`` (in place; returns the model)."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, rules)
    state = jax.device_put(state, shardings)
    nnx.update(model, state)
    return model
