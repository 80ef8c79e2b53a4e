"""A model role (actor, critic, reference) on the mesh: sharded parameters, optimizer state and jitted steps.

Every hot step is a ``jax.jit`` with explicit input/output shardings: parameters and
optimizer state keep the layout their logical axes give them (FSDP / tensor
parallel), batch arrays are split over the batch axes, metrics are replicated.
Updates donate the old parameters and optimizer state.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rlhf_jax.parallel import batch_sharding, replicated
from rlhf_jax.train import steps


class Role:
    """One model with optional optimizer; ``params`` / ``opt_state`` are replaced by each update."""

    def __init__(self, model: nnx.Module, mesh: Mesh, tx: optax.GradientTransformation | None = None, lr_fn: Callable | None = None):
        self.graphdef, self.params = nnx.split(model)
        self.config = model.config
        self.task = model.task
        self.mesh = mesh
        self.tx, self.lr_fn = tx, lr_fn
        self.param_shardings = jax.tree.map(lambda x: x.sharding, self.params)
        self.opt_state = None
        self.opt_shardings = None
        if tx is not None:
            abstract = jax.eval_shape(tx.init, self.params)
            self.opt_shardings = optax.tree_map_params(
                tx, lambda _, s: s, abstract, self.param_shardings, transform_non_params=lambda _: replicated(mesh)
            )
            self.opt_state = jax.jit(tx.init, out_shardings=self.opt_shardings)(self.params)
        self._compiled: dict[tuple, Callable] = {}

    # ----------------------------------------------------------------- helpers
    def model(self) -> nnx.Module:
        """An NNX view of the current parameters (for sampling and export)."""
        return nnx.merge(self.graphdef, self.params)

    def _batch_shardings(self, batch: dict) -> dict[str, NamedSharding]:
        return {k: batch_sharding(self.mesh, v.ndim) for k, v in batch.items()}

    def _jit(self, key: tuple, make: Callable[[], Callable]) -> Callable:
        if key not in self._compiled:
            self._compiled[key] = make()
        return self._compiled[key]

    def update_count(self) -> int:
        """Optimizer updates applied so far (read from the optimizer state's step counter)."""
        counts = [x for x in jax.tree.leaves(self.opt_state) if getattr(x, "ndim", 1) == 0 and "int" in str(x.dtype)]
        return int(counts[0]) if counts else 0

    # ----------------------------------------------------------------- forward passes
    def log_probs(self, batch: dict, *, n_micro: int, temperature: float, with_entropy: bool = False):
        keys = ("input_ids", "attention_mask", "responses")
        inputs = {k: batch[k] for k in keys}
        fn = self._jit(
            ("logp", n_micro, temperature, with_entropy, tuple((k, v.shape) for k, v in inputs.items())),
            lambda: jax.jit(
                functools.partial(steps.forward_log_probs, self.graphdef, n_micro=n_micro, temperature=temperature,
                                  with_entropy=with_entropy),
                in_shardings=(self.param_shardings, self._batch_shardings(inputs)),
                out_shardings=batch_sharding(self.mesh, 2) if not with_entropy else (batch_sharding(self.mesh, 2),) * 2,
            ),
        )
        return fn(self.params, inputs)

    def values(self, batch: dict, *, n_micro: int):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "responses")}
        fn = self._jit(
            ("values", n_micro, tuple((k, v.shape) for k, v in inputs.items())),
            lambda: jax.jit(
                functools.partial(steps.forward_values, self.graphdef, n_micro=n_micro),
                in_shardings=(self.param_shardings, self._batch_shardings(inputs)),
                out_shardings=batch_sharding(self.mesh, 2),
            ),
        )
        return fn(self.params, inputs)

    # ----------------------------------------------------------------- updates
    def _update(self, name: str, step_fn: Callable, spec: Any, mb: dict, extra: tuple, n_micro: int) -> dict:
        rep = replicated(self.mesh)
        fn = self._jit(
            (name, spec, n_micro, tuple((k, v.shape) for k, v in mb.items())),
            lambda: jax.jit(
                functools.partial(step_fn, self.graphdef, self.tx, spec, n_micro=n_micro),
                in_shardings=(self.param_shardings, self.opt_shardings, self._batch_shardings(mb)) + (rep,) * len(extra),
                out_shardings=(self.param_shardings, self.opt_shardings, rep),
                donate_argnums=(0, 1),
            ),
        )
        self.params, self.opt_state, metrics = fn(self.params, self.opt_state, mb, *extra)
        return metrics

    def update_actor(self, spec: steps.ActorLossSpec, mb: dict, rng: jax.Array, *, n_micro: int) -> dict:
        return self._update("actor_update", steps.actor_update, spec, mb, (rng,), n_micro)

    def update_critic(self, spec: steps.CriticLossSpec, mb: dict, *, n_micro: int) -> dict:
        return self._update("critic_update", steps.critic_update, spec, mb, (), n_micro)

    def num_compiled(self) -> int:
        return len(self._compiled)
