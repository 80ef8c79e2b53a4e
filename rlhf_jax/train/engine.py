"""A model role (actor, critic, reference) on the mesh: sharded parameters, optimizer state and jitted steps.

Every hot step is a ``jax.jit`` with explicit input/output shardings: parameters and optimizer state keep the layout
their logical axes give them (FSDP / tensor parallel), batch arrays are split over the batch axes, metrics are
replicated. Updates donate the old parameters and optimizer state. Roles described alike share their programs.

A role may train only part of its parameters (frozen groups, or only the LoRA adapters): ``params`` holds the
trained ones, ``frozen`` the rest. Gradients and optimizer state exist only for ``params``; ``frozen`` is passed to
every step unchanged and never donated, so another role (the reference under LoRA) can share its arrays.

Parameters and optimizer state may live in host memory between programs (``train/offload.py``): each program
copies them to the devices first, and the updates write them back to host memory.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from rlhf_jax.models.sequence_split import traced_with_split
from rlhf_jax.parallel import batch_sharding, replicated
from rlhf_jax.runtime import programs
from rlhf_jax.train import packed_steps, steps
from rlhf_jax.train.losses import Loss
from rlhf_jax.train.offload import HOST_MEMORY, any_in_host, device_copy, place, reading_on_devices, to_device, to_host
from rlhf_jax.types import TrainBatch, shape_key

__all__ = ["HOST_MEMORY", "Role"]


class Role:
    """One model with optional optimizer; ``params`` / ``opt_state`` are replaced by each update."""

    def __init__(self, model: nnx.Module, mesh: Mesh, tx: optax.GradientTransformation | None = None,
                 lr_fn: Callable | None = None, trainable: Callable | None = None, offload: bool = False,
                 offload_optimizer: bool = False):
        """``trainable``: an ``nnx`` filter ``(path, value) -> bool`` of the trained parameters (None: all).
        ``offload``: the parameters live in host memory (``pinned_host``) between programs, and each program copies
        them to the devices it runs on; under LoRA only the frozen base does (the adapters are a small fraction of
        the model and change every update). ``offload_optimizer``: the optimizer state too. Arrays that arrive in
        host memory (the LoRA base another role offloaded) stay there either way."""
        self.graphdef, self.params, self.frozen = nnx.split(model, trainable or nnx.Param, ...)
        self.config = model.config
        self.task = model.task
        self.mesh = mesh
        self.tx, self.lr_fn = tx, lr_fn
        self.param_shardings = jax.tree.map(lambda x: x.sharding, self.params)
        self.frozen_shardings = jax.tree.map(lambda x: x.sharding, self.frozen)
        if offload:
            if not getattr(self.config, "lora", None):
                self.param_shardings = to_host(self.param_shardings)
                self.params = place(self.params, self.param_shardings)
            self.frozen_shardings = to_host(self.frozen_shardings)
            self.frozen = place(self.frozen, self.frozen_shardings)
        # what the gradient accumulator of the packed updates and every device copy use
        self.grad_shardings = to_device(self.param_shardings)
        self.opt_state = None
        self.opt_shardings = None
        if tx is not None:
            abstract = jax.eval_shape(tx.init, self.params)
            # state shaped like its parameter (moments) is sharded like it; other per-parameter state (Adafactor's
            # factored row / column moments) is small and replicated
            self.opt_shardings = optax.tree_map_params(
                tx, lambda leaf, s, p: s if leaf.shape == p.shape else replicated(mesh), abstract,
                self.grad_shardings, self.params, transform_non_params=lambda _: replicated(mesh)
            )
            if offload_optimizer:
                self.opt_shardings = to_host(self.opt_shardings)
            if all(isinstance(x, jax.Array) for x in jax.tree.leaves(self.params)):
                init = reading_on_devices(tx.init, self.param_shardings)
                self.opt_state = jax.jit(init, in_shardings=(self.param_shardings,),
                                         out_shardings=self.opt_shardings)(self.params)
            else:  # abstract parameters (compiling for another target, rlhf_jax/plan): shapes and shardings only
                self.opt_state = place(abstract, self.opt_shardings)
        self._compiled: dict[tuple, Callable] = {}  # this role's programs, found in the process's store or built
        # what they are built from besides their own keys (a role described alike shares them: runtime/programs.py);
        # a training program also from the optimizer and its state's layout
        forward = (self.graphdef, self.mesh, shape_key(self.params), shape_key(self.frozen),
                   *map(programs.tree_description, (self.param_shardings, self.frozen_shardings)))
        self._described = {False: programs.Described(*forward),
                           True: programs.Described(*forward, self.tx, programs.tree_description(self.opt_shardings))}

    # ----------------------------------------------------------------- helpers
    def model(self) -> nnx.Module:
        """An NNX view of the current parameters (for export), on the devices."""
        return nnx.merge(self.graphdef, device_copy(self.params), device_copy(self.frozen))

    def state(self) -> nnx.State:
        """Every parameter (trained and frozen) as one state; no copy."""
        return nnx.merge_state(self.params, self.frozen)

    def state_shardings(self):
        return nnx.merge_state(self.param_shardings, self.frozen_shardings)

    def device_state(self) -> nnx.State:
        """``state()`` with its host-memory arrays copied to the devices (for a reader outside the role's programs:
        the sampler); the copy is freed when the reader drops it."""
        return device_copy(self.state())

    @property
    def offload(self) -> bool:
        """Whether any of the role's arrays live in host memory between programs."""
        return any_in_host((self.param_shardings, self.frozen_shardings, self.opt_shardings))

    def load_trained(self, state: nnx.State) -> None:
        """Take the trained parameters from a whole state (a restored checkpoint), placed where the role keeps them.
        The frozen ones are kept: they equal the checkpoint's, and another role may share their arrays."""
        trained = {path for path, _ in nnx.to_flat_state(self.params)}
        params = nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(state) if p in trained])
        self.params = jax.device_put(params, self.param_shardings)

    def load_opt_state(self, opt_state: Any) -> None:
        """Take a (restored) optimizer state, placed where the role keeps it."""
        self.opt_state = jax.device_put(opt_state, self.opt_shardings)

    def _on_devices(self, step_fn: Callable, *shardings: Any) -> Callable:
        """``step_fn(state, ...)`` as a program input: the state's (or the arguments of ``shardings``') host-memory
        arrays are copied to the devices inside the program, the first thing it does; traced under the mesh's
        sequence split (``models.sequence_split``: activations split along the sequence over ``context``)."""
        return reading_on_devices(traced_with_split(step_fn, self.mesh), *(shardings or (self.state_shardings(),)))

    def _batch_shardings(self, batch: Any) -> Any:
        """Row shardings of every array of a batch (a TrainBatch, or a dict of arrays)."""
        return jax.tree.map(lambda v: batch_sharding(self.mesh, v.ndim), batch)

    def _jit(self, key: tuple, make: Callable[[], Callable], training: bool = False) -> Callable:
        if key not in self._compiled:
            self._compiled[key] = programs.shared((self._described[training], "jit", key), make)
        return self._compiled[key]

    def update_count(self) -> int:
        """Optimizer updates applied so far (read from the optimizer state's step counter)."""
        counts = [x for x in jax.tree.leaves(self.opt_state) if getattr(x, "ndim", 1) == 0 and "int" in str(x.dtype)]
        return int(counts[0]) if counts else 0

    # ----------------------------------------------------------------- forward passes
    def _logp_fn(self, inputs: TrainBatch, n_micro: int, temperature: float, with_entropy: bool,
                 with_sum_pi_squared: bool = False, record_routes: bool = False, topk: int = 0) -> Callable:
        two = with_entropy or with_sum_pi_squared
        rows = batch_sharding(self.mesh, 3 if topk else 2)
        out = (rows,) * 2 if two or topk else rows
        return self._jit(
            ("logp", n_micro, temperature, with_entropy, with_sum_pi_squared, record_routes, topk, shape_key(inputs)),
            lambda: jax.jit(
                self._on_devices(functools.partial(steps.forward_log_probs, self.graphdef, n_micro=n_micro,
                                                   temperature=temperature, with_entropy=with_entropy,
                                                   with_sum_pi_squared=with_sum_pi_squared,
                                                   record_routes=record_routes, topk=topk)),
                in_shardings=(self.state_shardings(), self._batch_shardings(inputs)),
                out_shardings=(out, batch_sharding(self.mesh, 4)) if record_routes else out,
            ),
        )

    def _values_fn(self, inputs: TrainBatch, n_micro: int) -> Callable:
        return self._jit(
            ("values", n_micro, shape_key(inputs)),
            lambda: jax.jit(
                self._on_devices(functools.partial(steps.forward_values, self.graphdef, n_micro=n_micro)),
                in_shardings=(self.state_shardings(), self._batch_shardings(inputs)),
                out_shardings=batch_sharding(self.mesh, 2),
            ),
        )

    def log_probs(self, batch: TrainBatch, *, n_micro: int, temperature: float, with_entropy: bool = False,
                  with_sum_pi_squared: bool = False, record_routes: bool = False, topk: int = 0):
        """Response log-probs (N, R) of the batch's sequences (and entropies with ``with_entropy``, or the sums of
        squared probabilities with ``with_sum_pi_squared``); ``record_routes``: (those, the MoE expert ids used);
        ``topk`` > 0: the top-k (log-probs, ids) (N, R, k) of every response position instead."""
        inputs = batch.sequences()
        fn = self._logp_fn(inputs, n_micro, temperature, with_entropy, with_sum_pi_squared, record_routes, topk)
        return fn(self.state(), inputs)

    def values(self, batch: TrainBatch, *, n_micro: int):
        """Values (N, R) of the states before each response token."""
        inputs = batch.sequences()
        return self._values_fn(inputs, n_micro)(self.state(), inputs)

    # ----------------------------------------------------------------- updates
    def _update_fn(self, name: str, step_fn: Callable, spec: Any, mb: Any, n_extra: int, n_micro: int) -> Callable:
        rep = replicated(self.mesh)
        return self._jit(
            (name, step_fn, spec, n_micro, shape_key(mb)),
            lambda: jax.jit(
                self._on_devices(functools.partial(step_fn, self.graphdef, self.tx, spec, n_micro=n_micro),
                                 self.param_shardings, self.frozen_shardings, self.opt_shardings),
                in_shardings=(self.param_shardings, self.frozen_shardings, self.opt_shardings,
                              self._batch_shardings(mb)) + (rep,) * n_extra,
                out_shardings=(self.param_shardings, self.opt_shardings, rep),
                donate_argnums=(0, 2),
            ), training=True)

    def update(self, loss: Loss, mb: TrainBatch, *, n_micro: int, rng: jax.Array | None = None) -> dict:
        """One optimizer step of ``loss`` on the padded mini-batch ``mb`` (gradients over ``n_micro``
        micro-batches); ``rng`` for a loss that takes a key."""
        extra = (rng,) if loss.takes_rng else ()
        fn = self._update_fn(loss.name, loss.padded_step, loss.spec, mb, len(extra), n_micro)
        self.params, self.opt_state, metrics = fn(self.params, self.frozen, self.opt_state, mb, *extra)
        return metrics

    def update_program(self, name: str, step_fn: Callable, spec: Any, batch_specs: dict, *, n_micro: int) -> Any:
        """An update of another loss, compiled ahead of time for a mini-batch of ``batch_specs`` ({key: (shape,
        dtype)}). ``step_fn(graphdef, tx, spec, params, frozen, opt_state, mb, *, n_micro)`` returns (params,
        opt_state, metrics), as ``steps.actor_update`` does; ``apply_program`` runs it."""
        def make():
            inputs = self._abstract(batch_specs)
            return (self._update_fn(name, step_fn, spec, inputs, 0, n_micro),
                    (self.params, self.frozen, self.opt_state, inputs))

        return self._compile(("aot", name, step_fn, spec, n_micro, tuple(sorted(batch_specs.items()))), make, True)

    def apply_program(self, program: Any, mb: dict) -> dict:
        """One optimizer step of an ``update_program`` on the mini-batch ``mb``; returns its metrics."""
        self.params, self.opt_state, metrics = program(self.params, self.frozen, self.opt_state, mb)
        return metrics

    def _placed(self, batch: Any) -> Any:
        """Abstract arrays of the shapes and dtypes of ``batch``'s, split over the batch axes."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), jnp.dtype(x.dtype),
                                                           sharding=batch_sharding(self.mesh, x.ndim)), batch)

    def _key_spec(self) -> jax.ShapeDtypeStruct:
        key = jax.eval_shape(lambda: jax.random.key(0))
        return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated(self.mesh))

    def padded_program(self, kind: str | Loss, batch: TrainBatch, *, n_micro: int, temperature: float = 1.0,
                       sum_pi_squared: bool = False, topk: int = 0) -> Any:
        """A padded pass compiled for the abstract ``batch`` (for the memory plan): "logp", "values", or the
        update of a ``Loss``."""
        batch = self._placed(batch)
        if kind == "logp":
            fn = self._logp_fn(batch, n_micro, temperature, False, sum_pi_squared, topk=topk)
            return fn.lower(self.state(), batch).compile()
        if kind == "values":
            return self._values_fn(batch, n_micro).lower(self.state(), batch).compile()
        extra = (self._key_spec(),) if kind.takes_rng else ()
        fn = self._update_fn(kind.name, kind.padded_step, kind.spec, batch, len(extra), n_micro)
        return fn.lower(self.params, self.frozen, self.opt_state, batch, *extra).compile()

    # ----------------------------------------------------------------- packed passes
    # Packed passes are compiled ahead of time (``lower(...).compile()``) from abstract shapes, so the memory
    # plan can read XLA's estimate before the first step and the step then reuses the same executable.
    def _abstract(self, specs: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(self.mesh, len(shape)))
                for k, (shape, dtype) in specs.items()}

    def _compile(self, key: tuple, make: Callable[[], tuple[Callable, tuple]], training: bool = False) -> Any:
        """The executable cached under ``key``; ``make`` returns (jitted function, example arguments)."""
        if key not in self._compiled:
            self._compiled[key] = programs.shared((self._described[training], "compiled", key),
                                                  lambda: programs.compile_example(*make()))
        return self._compiled[key]

    def _packed_micro(self, micro_shape: tuple[int, int], logit_size: int, routes: tuple | None = None) -> dict:
        """An abstract packed micro-batch; ``routes`` (sparse layers, K): it carries expert ids to replay."""
        shapes = {k: (micro_shape, jnp.int32) for k in packed_steps.ROW_KEYS}
        shapes.update({k: ((logit_size,), jnp.int32) for k in packed_steps.LOGIT_KEYS})
        if routes is not None:
            shapes["routes"] = (tuple(micro_shape) + tuple(routes), jnp.int32)
        return self._abstract(shapes)

    @staticmethod
    def _micro_routes(micro: dict) -> tuple | None:
        """(sparse layers, K) of the expert ids a micro-batch replays, or None."""
        return tuple(micro["routes"].shape[2:]) if "routes" in micro else None

    def packed_forward_program(self, kind: str, micro_shape: tuple[int, int], logit_size: int,
                               grid_shape: tuple[int, int], dp: int, routes: tuple | None = None,
                               record_routes: bool = False, **static) -> Any:
        """The compiled forward pass ``kind`` ("logp" or "values") over one packed micro-batch of ``micro_shape``
        rows with ``logit_size`` predicted positions; ``routes``: (sparse layers, K) of the expert ids it replays;
        ``record_routes``: it also returns the expert ids it used (log-probs only)."""

        def make():
            step_fn = packed_steps.forward_log_probs if kind == "logp" else packed_steps.forward_values
            rows = batch_sharding(self.mesh, 2)
            micro = self._packed_micro(micro_shape, logit_size, routes)
            grid = jax.ShapeDtypeStruct(grid_shape, jnp.float32, sharding=rows)
            if static.get("sum_pi_squared"):  # two grids: log-probs and sums of squared probabilities
                grid, rows = (grid, grid), (rows, rows)
            if static.get("topk"):  # two (rows, R, k) grids: the top-k log-probs and token ids
                rows = (batch_sharding(self.mesh, 3),) * 2
                grid = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rows[0])
                             for s in packed_steps.topk_grids(grid_shape, static["topk"]))
            record = {"record_routes": True} if record_routes else {}
            fn = jax.jit(self._on_devices(functools.partial(step_fn, self.graphdef, dp=dp, **static, **record)),
                         in_shardings=(self.state_shardings(), rows, self._batch_shardings(micro)),
                         out_shardings=(rows, batch_sharding(self.mesh, 4)) if record_routes else rows,
                         donate_argnums=(1,))
            return fn, (self.state(), grid, micro)

        return self._compile(("packed_" + kind, tuple(micro_shape), logit_size, tuple(grid_shape), dp, routes,
                              record_routes, tuple(sorted(static.items()))), make)

    def _packed_forward(self, kind: str, micros: list[dict], grid_shape: tuple[int, int], dp: int,
                        route_grid: jax.Array | None = None, **static):
        grid = jax.device_put(jnp.zeros(grid_shape, jnp.float32), batch_sharding(self.mesh, 2))
        if static.get("sum_pi_squared"):
            grid = (grid, jax.device_put(jnp.zeros(grid_shape, jnp.float32), batch_sharding(self.mesh, 2)))
        if static.get("topk"):
            grid = tuple(jax.device_put(jnp.zeros(s.shape, s.dtype), batch_sharding(self.mesh, 3))
                         for s in packed_steps.topk_grids(grid_shape, static["topk"]))
        record = route_grid is not None
        for micro in micros:
            inputs = {k: v for k, v in micro.items() if k != "route_sources"}
            program = self.packed_forward_program(kind, micro["input_ids"].shape, micro["logit_positions"].shape[0],
                                                  grid_shape, dp, self._micro_routes(micro), record, **static)
            grid = program(self.state(), grid, inputs)
            if record:
                grid, used = grid
                route_grid = self._route_scatter(dp)(used, micro["route_sources"], route_grid)
        return (grid, route_grid) if record else grid

    def _route_scatter(self, dp: int) -> Callable:
        return self._jit(("scatter_routes", dp), lambda: jax.jit(
            functools.partial(packed_steps.scatter_routes, dp=dp), out_shardings=batch_sharding(self.mesh, 4),
            donate_argnums=(2,)))

    def log_probs_packed(self, micros: list[dict], grid_shape: tuple[int, int], *, dp: int, temperature: float,
                         sum_pi_squared: bool = False, topk: int = 0, route_grid: jax.Array | None = None):
        """Response log-probs (rows, R) of packed micro-batches (device dicts of (dp*M, L) arrays, with ``routes``
        to replay where they carry them); with ``sum_pi_squared`` (that, the sums of squared probabilities);
        ``topk`` > 0: the top-k (log-probs, ids) (rows, R, k) instead; with ``route_grid`` (rows, P + R, sparse
        layers, K) (that, ``route_grid`` (donated) with the expert ids used at each position the micro-batches'
        ``route_sources`` name written in)."""
        static = {"sum_pi_squared": True} if sum_pi_squared else {"topk": topk} if topk else {}
        return self._packed_forward("logp", micros, grid_shape, dp, route_grid, temperature=temperature, **static)

    def values_packed(self, micros: list[dict], grid_shape: tuple[int, int], *, dp: int):
        return self._packed_forward("values", micros, grid_shape, dp)

    def packed_grads_program(self, loss: Loss, micro_shape: tuple[int, int], logit_size: int, grid: TrainBatch,
                             dp: int, routes: tuple | None = None) -> Any:
        """The compiled gradient of ``loss`` on one packed micro-batch, accumulated into a donated buffer;
        ``grid`` is the mini-batch's (abstract or concrete) per-token arrays; ``routes``: (sparse layers, K) of
        the expert ids the micro-batch replays."""
        grid = self._placed(grid)

        def make():
            rep = replicated(self.mesh)
            micro = self._packed_micro(micro_shape, logit_size, routes)
            extra = (self._key_spec(),) if loss.takes_rng else ()
            fn = jax.jit(self._on_devices(functools.partial(loss.packed_grads, self.graphdef, loss.spec, dp=dp),
                                          self.param_shardings, self.frozen_shardings),
                         in_shardings=(self.param_shardings, self.frozen_shardings, self.grad_shardings,
                                       self._batch_shardings(micro), self._batch_shardings(grid)) + (rep,) * len(extra),
                         out_shardings=(self.grad_shardings, rep, rep), donate_argnums=(2,))
            return fn, (self.params, self.frozen, place(self.params, self.grad_shardings), micro, grid, *extra)

        return self._compile(("packed_grads", loss, tuple(micro_shape), logit_size, shape_key(grid), dp, routes),
                             make)

    def _apply_program(self) -> Callable:
        rep = replicated(self.mesh)
        return self._jit(("apply_grads",), lambda: jax.jit(
            reading_on_devices(functools.partial(steps.apply_update, self.tx), self.param_shardings,
                               self.opt_shardings),
            in_shardings=(self.param_shardings, self.opt_shardings, self.grad_shardings),
            out_shardings=(self.param_shardings, self.opt_shardings, rep), donate_argnums=(0, 1)), training=True)

    def apply_grads_program(self) -> Any:
        """The packed updates' optimizer step (accumulated gradients in, new parameters and state out), compiled."""
        grads = place(self.params, self.grad_shardings)
        return self._apply_program().lower(self.params, self.opt_state, grads).compile()

    def _zero_grads(self):
        """The gradient accumulator of a packed update, in device memory (made from the shapes alone: an offloaded
        role's parameters are not read)."""
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params)
        return self._jit(("zero_grads",), lambda: jax.jit(
            lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
            out_shardings=self.grad_shardings))()

    def update_packed(self, loss: Loss, micros: list[dict], grid: TrainBatch, *, dp: int,
                      rng: jax.Array | None = None) -> dict:
        """One optimizer step of ``loss`` over packed micro-batches; ``grid`` holds the mini-batch's (rows, R)
        arrays."""
        keys = jax.random.split(rng, len(micros)) if loss.takes_rng else None
        grads, per_micro, tokens = self._zero_grads(), [], []
        for i, micro in enumerate(micros):
            extra = (keys[i],) if keys is not None else ()
            program = self.packed_grads_program(loss, micro["input_ids"].shape, micro["logit_positions"].shape[0],
                                                grid, dp, self._micro_routes(micro))
            grads, aux, count = program(self.params, self.frozen, grads, micro, grid, *extra)
            per_micro.append(aux)
            tokens.append(count)
        self.params, self.opt_state, grad_norm = self._apply_program()(self.params, self.opt_state, grads)
        return steps.combine_micro_metrics(per_micro, tokens) | {f"{loss.name}/grad_norm": grad_norm}

    def num_compiled(self) -> int:
        return len(self._compiled)
