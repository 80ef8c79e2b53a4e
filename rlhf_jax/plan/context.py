"""``mesh.context=0`` (automatic): the smallest sequence split with which the run fits its devices.

A split costs collectives in every layer and, with ``mesh.data=-1``, data-parallel shards, so the answer is 1
wherever one device can hold a whole sequence's update. The arithmetic bound of ``train/pass_bound.py`` (never
below XLA's estimate) says so without compiling anything: the actor's update over one sequence of
``derived.max_seq_len`` tokens, plus every parameter, gradient and optimizer state of the actor, reference and
critic in float32, each device holding its share of them as the run's mesh shards the parameters (an array a
rule leaves whole, or whose dimension the mesh does not divide, counts whole), within the usable memory. Where the
bound cannot promise it, each split 1, 2, 4, ... whose mesh and batch sizes divide is planned as ``python -m
rlhf_jax.plan`` plans it (every program compiled for the devices on abstract weights, the memory plan's
micro-batches shrunk to fit), and the first that fits is taken.

``main`` resolves the key this way before the trainer is built; the plan command does the same for its target.
Everything else that finalizes a config reads 0 as 1 (an unsplit pass).
"""

from __future__ import annotations

import logging
from typing import Callable

import jax
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from rlhf_jax import algos, models
from rlhf_jax.models import TASK_CAUSAL_LM
from rlhf_jax.parallel import groups
from rlhf_jax.plan.abstract import abstract_model, hf_config, model_config
from rlhf_jax.plan.arithmetic import ModelShape
from rlhf_jax.plan.programs import meshes
from rlhf_jax.plan.run import ResidentMemoryError, RunPlan, _usable, finalized, local_target, plan_run
from rlhf_jax.plan.targets import target, target_devices
from rlhf_jax.train.pass_bound import pass_bound_bytes, tree_bytes
from rlhf_jax.train.passes import HEADROOM, per_device_bytes

log = logging.getLogger(__name__)
AUTOMATIC = 0
# bytes per parameter the bound counts resident: float32 weights, gradients and two Adam moments, and a float32
# reference copy (each sharded as the parameters are)
_RESIDENT_PER_PARAM = 5 * 4


def with_context(cfg: ConfigDict, context: int) -> ConfigDict:
    out = ConfigDict(cfg.to_dict())
    out.mesh.context = context
    return out


def candidates(cfg: ConfigDict, devices: int, hosts: int) -> dict[int, ConfigDict]:
    """The splits 1, 2, 4, ... (up to ``devices``) for which the config finalizes (the mesh axes multiply to the
    devices and the batch sizes divide the data-parallel shards that remain), each with its finalized config. The
    unsplit config's error is raised as it is where no split finalizes: a config no split mends (a bad key) is
    named, not reported as a split that does not divide."""
    out, context, unsplit_error = {}, 1, None
    while context <= devices:
        try:
            out[context] = finalized(with_context(cfg, context), devices, hosts)
        except ValueError as e:
            unsplit_error = unsplit_error or e
        context *= 2
    if not out:
        raise unsplit_error
    return out


def parameter_share(cfg: ConfigDict, devices: list) -> float:
    """The largest fraction of the actor's parameter bytes one of ``devices`` holds under the finalized ``cfg``'s
    mesh and sharding rules (abstract parameters: nothing is allocated or compiled)."""
    mesh, _, rules = meshes(cfg, devices)
    hf = hf_config(cfg.actor_rollout_ref.model.path)
    params = nnx.state(abstract_model(model_config(cfg, hf, "actor"), TASK_CAUSAL_LM, mesh, rules))
    return per_device_bytes(params) / max(1, tree_bytes(params))


def unsplit_surely_fits(cfg: ConfigDict, usable: int, devices: list) -> bool:
    """Whether the arithmetic bound of one whole sequence's actor update at context 1, beside every parameter and
    optimizer state in float32 at its share on one of ``devices``, stays within ``usable`` bytes (see the module
    doc); ``cfg`` is finalized."""
    model = models.from_hf_dict(hf_config(cfg.actor_rollout_ref.model.path))
    params = ModelShape.of(model).total_params()
    if algos.estimator_info(cfg.algorithm.adv_estimator).needs_critic:  # a value model of the same size
        params *= 2
    share = parameter_share(cfg, devices)  # gradients and their accumulator are sharded as the parameters
    bound = pass_bound_bytes(model, rows=1, row_len=int(cfg.derived.max_seq_len), batch_rows=1,
                             trained_bytes=int(4 * params * share))
    return bound + _RESIDENT_PER_PARAM * params * share <= HEADROOM * usable


def choose_context(cfg: ConfigDict, topology: str | None = None, *, progress: Callable[[str], None] = lambda _: None,
                   usable_bytes: int | None = None) -> tuple[int, RunPlan | None]:
    """(mesh.context, the plan that chose it or None) for ``cfg``: its own ``mesh.context`` unless 0 (automatic);
    then 1 when ``unsplit_surely_fits``, else the smallest candidate split whose plan fits ``topology`` (None: the
    devices JAX sees). Raises ``MemoryError`` naming the largest split tried when none fits, or the unsplit plan's
    ``ResidentMemoryError`` (the resident arrays alone, which no split shrinks). ``usable_bytes``: the
    memory per device to plan against, as ``plan_run``'s. The processes of a run on several hosts each measure
    their own host's free memory, so they agree on the largest split any of them chose (one collective)."""
    # the processes that train together (a split run's sampling processes plan nothing)
    together = topology in (None, "local") and groups.process_count() > 1 and int(cfg.mesh.context) == AUTOMATIC
    if not together:
        return _choose(cfg, topology, progress, usable_bytes)
    try:
        context, plan, failure = *_choose(cfg, topology, progress, usable_bytes), None
    except (MemoryError, ValueError) as e:  # the others must hear of it, or they would wait for this process
        context, plan, failure = -1, None, e
    chosen = [int(c) for c in groups.allgather(np.int32(context))]
    if min(chosen) < 0:
        raise failure or MemoryError(f"mesh.context=0 (automatic): process {chosen.index(-1)} found no split that "
                                     "fits its host's free memory; set mesh.context")
    if max(chosen) != context:
        progress(f"mesh.context=0 (automatic): {max(chosen)}, the largest split another process needs")
        context, plan = max(chosen), None
    return context, plan


def _choose(cfg: ConfigDict, topology: str | None, progress: Callable[[str], None],
            usable_bytes: int | None) -> tuple[int, RunPlan | None]:
    if int(cfg.mesh.context) != AUTOMATIC:
        return int(cfg.mesh.context), None
    local = topology in (None, "local")
    t = local_target() if local else target(topology)
    devices = jax.devices() if local else target_devices(t)  # the whole run's: the plan splits it (meshes)
    tried = candidates(cfg, len(devices), t.hosts)
    usable = _usable(t) if usable_bytes is None else usable_bytes
    if 1 in tried and unsplit_surely_fits(tried[1], usable, devices):
        log.info("mesh.context=0 (automatic): 1 (one sequence's update surely fits a device unsplit)")  # quiet:
        return 1, None  # the common case, decided in a second; ``progress`` hears of the splits planned
    last = None
    for context in tried:
        progress(f"mesh.context=0 (automatic): planning mesh.context={context} ...")
        try:
            plan = plan_run(with_context(cfg, context), topology, progress=progress, usable_bytes=usable_bytes)
        except ResidentMemoryError:  # as large at every split: its own message names the keys that help
            raise
        except MemoryError as e:
            last = e
            progress(f"mesh.context={context} does not fit: {str(e).splitlines()[0]}")
            continue
        progress(f"mesh.context=0 (automatic): {context}, the smallest split that fits")
        return context, plan
    raise MemoryError(f"mesh.context=0 (automatic): no split up to mesh.context={context} fits; at that split: "
                      f"{str(last).splitlines()[0]}")
