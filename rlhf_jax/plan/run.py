"""The plan of a run on a target: every program compiled for it, the memory plan's micro-batches, costs and verdict.

The training passes go through the memory plan a run makes before its first step (``train/passes.fit_pass``:
automatic micro-batches shrink until XLA's estimate fits, a size the user set that does not fit is an error naming
its keys), against the target chip's memory less what the run keeps resident (parameters, optimizer state,
reference and critic). A supervised run (``algorithm.type`` sft or dpo) compiles its trainer's programs instead
(``supervised.py``), at the sizes the config sets: those trainers plan no micro-batch.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
from ml_collections import ConfigDict

from rlhf_jax.config import finalize
from rlhf_jax.parallel.backend import compiling_for
from rlhf_jax.plan import arithmetic as ar
from rlhf_jax.plan import programs as pg
from rlhf_jax.plan import supervised as sv
from rlhf_jax.plan.abstract import count_params
from rlhf_jax.plan.report import ProgramCost, program_cost
from rlhf_jax.parallel.chips import Chip, chip_of
from rlhf_jax.plan.targets import Target, target, target_devices
from rlhf_jax.rollout import scheduler
from rlhf_jax.runtime.oom import memory_hint
from rlhf_jax.train.passes import (HEADROOM, PassPlan, describe, fit_pass, gib, held_bytes, pass_bytes,
                                   per_device_bytes, plan_passes, refused_bytes)

ROLLOUT_KEYS = ("data.train_batch_size / actor_rollout_ref.rollout.n, actor_rollout_ref.rollout.max_num_seqs, "
                "data.max_prompt_length / max_response_length")
RESIDENT_KEYS = ("shard the parameters over more devices (mesh.fsdp), train LoRA adapters "
                 "(actor_rollout_ref.model.lora_rank), keep parameters in bfloat16 (actor_rollout_ref.model.dtype), "
                 "or keep them in host memory (actor_rollout_ref.actor.fsdp_config.param_offload / optimizer_offload)")


@dataclasses.dataclass
class RunPlan:
    target: Target
    devices: int
    model_name: str
    params: int
    programs: list[ProgramCost]
    passes: dict[str, PassPlan]
    resident_bytes: int
    usable_bytes: int
    sampling_s: float | None
    training_s: float | None
    problems: list[str]  # one line each: what does not fit and the keys to change
    host_bytes: int = 0  # per device: the shards of offloaded parameters and optimizer state, in host memory
    samples: bool = True  # the run samples (RL); a supervised run's step is all training

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def peak_bytes(self) -> int:
        return max([self.resident_bytes] + [p.peak_bytes for p in self.programs])

    @property
    def step_s(self) -> float | None:
        if not self.samples:
            return self.training_s
        return None if self.sampling_s is None or self.training_s is None else self.sampling_s + self.training_s

    @property
    def micro_batches(self) -> dict[str, str]:
        return {k: describe(v) for k, v in self.passes.items()}


def local_target() -> Target:
    """The devices JAX sees now, as a target (a real run's machine); a CPU's memory is the host's, shared."""
    from rlhf_jax.train.passes import free_device_memory

    dev = jax.devices()[0]
    chip = chip_of(dev) or Chip(dev.device_kind, int(free_device_memory() or 0), 0.0, 0.0)
    return Target("local", chip, dev.platform, jax.device_count(), jax.process_count(), "")


def finalized(cfg: ConfigDict, devices: int, hosts: int) -> ConfigDict:
    """``cfg`` checked and derived for ``devices`` devices over ``hosts`` processes (data files are not read)."""
    cfg = ConfigDict(cfg.to_dict())
    return finalize(cfg, num_devices=devices, num_processes=hosts, check_paths=False)


def _timed(progress: Callable[[str], None], what: str, fn: Callable):
    start = time.perf_counter()
    progress(f"{what} ...")
    out = fn()
    progress(f"{what}: {time.perf_counter() - start:.1f} s")
    return out


def plan_run(cfg: ConfigDict, topology: str | None = None, *, progress: Callable[[str], None] = lambda _: None,
             stop_at_first_problem: bool = True, usable_bytes: int | None = None, sampler: bool = True) -> RunPlan:
    """Compile every program of the run ``cfg`` describes for ``topology`` (a name of ``targets.TARGETS``; None or
    "local": the devices JAX sees) and return its plan. Nothing is allocated and no weight is read.

    What cannot fit raises ``MemoryError`` with one line naming the keys to change, at the first problem (before
    the remaining programs compile); with ``stop_at_first_problem=False`` every program is compiled and the
    problems are listed in ``RunPlan.problems``. ``usable_bytes``: plan against that much memory per device instead
    of the target's (a card with less memory, or a share of a host). ``sampler=False`` plans the training programs
    alone (the LoRA merge, the weight copy and the sampler are left out: their compile is the plan's longest)."""
    local = topology in (None, "local")
    t = local_target() if local else target(topology)
    devices = jax.devices() if local else target_devices(t)
    cfg = finalized(cfg, len(devices), t.hosts)
    # Executables for compile-only devices cannot be read back from jax's persistent compilation cache.
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", cache and local)
    try:
        with compiling_for(devices[0].platform, len(devices)):
            return _plan(cfg, t, devices, progress, stop_at_first_problem,
                         _usable(t) if usable_bytes is None else usable_bytes, sampler)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)


def _usable(t: Target) -> int:
    return int(t.chip.hbm_bytes) if t.name == "local" and t.platform == "cpu" else t.chip.usable_bytes(t.platform)


class ResidentMemoryError(MemoryError):
    """The parameters and optimizer state alone do not fit: no micro-batch or sequence split can help."""


class _Stop(Exception):
    """The first problem, when the plan stops at it."""


@dataclasses.dataclass
class _State:
    """What the parts of one plan share."""

    cfg: ConfigDict
    run: pg.RunParts | sv.SupervisedRun
    target: Target
    chip: Chip | None  # None: no peak figures (CPU)
    usable: int
    resident: int
    progress: Callable[[str], None]
    stop: bool
    problems: list[str] = dataclasses.field(default_factory=list)
    programs: list[ProgramCost] = dataclasses.field(default_factory=list)

    def problem(self, line: str) -> None:
        self.problems.append(line)
        if self.stop:
            raise _Stop(line)


def _plan(cfg: ConfigDict, t: Target, devices: list, progress, stop: bool, usable: int, sampler: bool) -> RunPlan:
    supervised = cfg.algorithm.type in sv.KINDS
    run = _timed(progress, "abstract models", lambda: sv.build(cfg, devices, t.hosts) if supervised
                 else pg.build_run(cfg, devices))
    resident_trees = [run.actor.params, run.actor.frozen, run.actor.opt_state]
    if run.ref is not None and not run.actor.config.lora:
        resident_trees.append(run.ref.params)
    if run.critic is not None:
        resident_trees += [run.critic.params, run.critic.opt_state]
    st = _State(cfg, run, t, t.chip if t.chip.peak_flops else None, usable, per_device_bytes(resident_trees),
                progress, stop)
    in_host = per_device_bytes(resident_trees, host=True)
    try:
        if st.resident > HEADROOM * st.usable:
            try:
                st.problem(f"parameters and optimizer state alone need {gib(st.resident)} per device, more than the "
                           f"{gib(HEADROOM * st.usable)} usable: {RESIDENT_KEYS}")
            except _Stop as e:
                raise ResidentMemoryError(str(e)) from None
        if supervised:
            plans, training_s, sampling_s = run.passes, _supervised(st), None
        else:
            plans, training_s = _training(st)  # the largest programs first: a run that cannot fit stops soonest
            sampling_s = _rollout(st) if sampler else None
    except _Stop as e:
        raise MemoryError(str(e)) from None
    order = ["lora_merge", "rollout_copy", "sampler"]
    programs = sorted(st.programs, key=lambda p: order.index(p.name) if p.name in order else len(order))
    return RunPlan(t, len(devices), str(run.hf.get("_name_or_path") or cfg.actor_rollout_ref.model.path),
                   count_params(run.actor.state()), programs, plans, st.resident, st.usable, sampling_s, training_s,
                   st.problems, in_host, samples=not supervised)


def _supervised(st: _State) -> float | None:
    """The programs of a supervised run (plan/supervised.py) compiled in order; returns the step's roofline time. A
    program that does not fit beside the resident arrays is a problem naming its keys (the trainers plan no
    micro-batch: the sizes are the config's)."""
    free = st.usable - st.resident
    training_s = 0.0 if st.chip is not None else None
    for p in st.run.programs:
        cost = _cost_or_refusal(lambda p=p: _timed(st.progress, f"compiling {p.name}", p.compile), p.name, st.chip,
                                calls=p.calls, looped=p.looped, resident_bytes=st.resident, resident_arg_bytes=p.held,
                                model_flops=p.flops, model_bytes=p.nbytes, note=p.note)
        st.programs.append(cost)
        if training_s is not None and p.in_step:
            training_s += cost.roofline_s or 0.0
        need = cost.peak_bytes - st.resident  # as train/passes.pass_bytes counts it
        if need > HEADROOM * free:
            st.problem(f"the {p.name} program needs about {gib(need)} per device beside the resident arrays (XLA's "
                       f"estimate: {p.note}), more than the {gib(HEADROOM * free)} usable: lower {p.keys}, "
                       f"{memory_hint(st.cfg, 'actor')}")
    return training_s


def _rollout(st: _State) -> float | None:
    """The LoRA merge, the weight copy onto rollout devices and the sampler; returns the sampling roofline time."""
    run, cfg, chip = st.run, st.cfg, st.chip
    d, arr = cfg.derived, cfg.actor_rollout_ref
    merge, merged_state, merged = pg.merge_program(run)
    weights = pg.sampler_weights(run, merged_state)
    weight_bytes = float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(weights)))
    merged_bytes = 0
    if merge is not None:
        resident, resident_args = st.resident, per_device_bytes(run.actor.state())
        if cfg.mesh.rollout_processes:  # the sampling processes merge into their own copy of the base weights
            resident = resident_args = per_device_bytes(pg.relocated(pg.device_state(run.actor), run.rollout_mesh))
        cost = _cost_or_refusal(lambda: _timed(st.progress, "compiling the LoRA merge", merge.compile), "lora_merge",
                                chip, resident_bytes=resident, resident_arg_bytes=resident_args,
                                note="adapters merged into the weights before each rollout")
        st.programs.append(cost)
        merged_bytes = per_device_bytes([merged])  # the merged weights are new arrays
        if cost.peak_bytes > HEADROOM * st.usable:
            st.problem(f"the LoRA merge needs about {gib(cost.peak_bytes)} per device (the weights and their merged "
                       f"copy for the sampler), more than the {gib(HEADROOM * st.usable)} usable: set "
                       "actor_rollout_ref.model.dtype=bfloat16, shard over more devices (mesh.fsdp), or sample on "
                       "devices of their own (mesh.rollout_devices)")
    prompts = pg.sampler_prompts(run)
    compile_sampler = lambda: _timed(st.progress, "compiling the sampler (prefill + decode loops)",  # noqa: E731
                                     lambda: pg.sampler_program(run, weights, prompts))
    mesh = run.rollout_mesh or run.mesh
    n_roll = mesh.devices.size
    shards = n_roll if run.rollout_mesh is not None else int(d.dp_size)
    R, P = run.sampling.max_new_tokens, int(cfg.data.max_prompt_length)
    slots = scheduler.num_slots(prompts * run.sampling.n, shards, run.sampling.max_num_seqs)
    tp_roll = 1 if run.rollout_mesh is not None else int(d.mesh_shape[2])
    context_roll = 1 if run.rollout_mesh is not None else int(d.mesh_shape[4])  # the cache's length split
    work = ar.decode_work(ar.ModelShape.of(run.actor.config), prompts=prompts, prompt_len=P, n=run.sampling.n,
                          response_len=R, slots=slots, weight_bytes_per_device=weight_bytes / tp_roll,
                          cache_itemsize=jax.numpy.dtype(arr.rollout.dtype).itemsize,
                          slots_per_device=slots / shards / tp_roll, length_split=context_roll)
    sampling_s = None
    if chip is not None:
        sampling_s = (work.prefill_flops / n_roll / chip.peak_flops
                      + work.decode_steps * max(work.step_flops / n_roll / chip.peak_flops,
                                                work.step_bytes_per_device / chip.hbm_bytes_per_s))
    if run.rollout_mesh is not None:
        held = per_device_bytes(weights)
        where = (f"sent to the {n_roll} devices of the sampling processes" if cfg.mesh.rollout_processes else
                 f"copied onto the {n_roll} rollout devices")
        what = "adapters" if cfg.mesh.rollout_processes and merge is not None else "weights"
        st.programs.append(dataclasses.replace(
            program_cost("rollout_copy", None, None), argument_bytes=held, peak_bytes=held,
            note=f"{what} {where} after each update (device to device)"))
        resident, resident_args = held, held
    elif arr.rollout.weight_dtype is not None:  # the sampler reads a copy of every weight, made for the rollout
        resident, resident_args = st.resident, 0
    else:  # the sampler's resident arguments: its weights less the merged ones and the copies of offloaded ones
        copied = per_device_bytes(pg.device_state(run.actor)) - per_device_bytes(run.actor.state())
        resident, resident_args = st.resident, per_device_bytes(weights) - merged_bytes - copied
    cost = _cost_or_refusal(compile_sampler, "sampler", chip, looped=True, resident_bytes=resident,
                            resident_arg_bytes=resident_args,
                        model_flops=(work.prefill_flops + work.decode_steps * work.step_flops) / n_roll,
                        model_bytes=work.decode_steps * work.step_bytes_per_device,
                        note=f"{prompts} prompts x n={run.sampling.n}, {slots} slots, {work.decode_steps} decode steps"
                        + (f", on the sampling processes' {n_roll} devices" if cfg.mesh.rollout_processes else ""))
    st.programs.append(dataclasses.replace(cost, roofline_s=sampling_s))
    if cost.peak_bytes > HEADROOM * st.usable:
        dtype = "" if arr.rollout.dtype == "bfloat16" else ", or set actor_rollout_ref.rollout.dtype=bfloat16"
        place = "" if run.rollout_mesh is not None else ", or sample on devices of its own (mesh.rollout_devices)"
        st.problem(f"the sampler needs about {gib(cost.peak_bytes)} per device, more than the "
                   f"{gib(HEADROOM * st.usable)} usable: lower {ROLLOUT_KEYS}{dtype}{place}")
    return sampling_s


def _training(st: _State) -> tuple[dict[str, PassPlan], float | None]:
    """The training passes through the memory plan (updates first); returns their plans and roofline time."""
    run, cfg, chip = st.run, st.cfg, st.chip
    d = cfg.derived
    plans = plan_passes(cfg, actor_mlp_width=run.actor.config.intermediate_size,
                        critic_mlp_width=run.critic.config.intermediate_size if run.critic else None,
                        backend=st.target.backend if st.target.name != "local" else None)
    shape = ar.ModelShape.of(run.actor.config)
    n_train, tensor, max_len = run.mesh.devices.size, int(d.mesh_shape[2]), int(d.max_seq_len)
    free = st.usable - st.resident
    training_s = 0.0 if chip is not None else None
    for name in sorted(plans, key=lambda n: not n.startswith("update")):
        plan, role = plans[name], pg.pass_role(run, name)
        if role is None:
            del plans[name]
            continue
        update = name.startswith("update")
        held = held_bytes(role, name)
        need_of = lambda c, held=held: pass_bytes(c, held)  # noqa: E731 - as Trainer.plan_memory measures it
        hint = memory_hint(cfg, "critic" if role is run.critic else "actor")
        compile_at = lambda p, name=name, role=role: pg.compile_training_pass(run, name, role, p)  # noqa: E731
        try:
            plan, _ = _timed(st.progress, f"compiling {name}", lambda: fit_pass(plan, compile_at, free, hint, need_of))
        except MemoryError as e:
            plan = getattr(e, "plan", plan)  # the smallest size tried, already compiled
            st.problem(str(e))
        plans[name] = plan
        calls, tokens, looped = _calls_and_tokens(cfg, name, plan, max_len)
        flops = ar.sequence_flops(shape, max(1, tokens // max_len), max_len) * (
            ar.training_multiplier(role.config.remat) if update else 1.0) / n_train
        reads = float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(role.state()))) / tensor
        cost = _cost_or_refusal(lambda: compile_at(plan), name, chip, calls=calls, looped=looped,
                                resident_bytes=st.resident, resident_arg_bytes=held, model_flops=flops,
                                model_bytes=reads * (3 if update else 1), note=describe(plan))
        st.programs.append(cost)
        if chip is not None:
            training_s += cost.roofline_s or 0.0
    order = ["old_log_prob", "ref", "values", "update_critic", "update_actor"]
    st.programs.sort(key=lambda p: order.index(p.name) if p.name in order else -1)
    return {k: plans[k] for k in order if k in plans}, training_s


def _cost_or_refusal(compile_it: Callable, name: str, chip, **kw) -> ProgramCost:
    """``program_cost`` of the compiled program; where the compiler refuses it for want of memory (XLA:TPU), a row
    with the memory it named as the program's temporaries."""
    try:
        compiled = compile_it()
    except Exception as e:  # noqa: BLE001 - only an out-of-memory refusal is handled
        named = refused_bytes(e)
        if named is None:
            raise
        cost = program_cost(name, None, chip, **{k: v for k, v in kw.items() if k != "note"})
        return dataclasses.replace(cost, temp_bytes=named, peak_bytes=kw.get("resident_bytes", 0) + named,
                                   note=f"{kw.get('note', '')}; XLA refused it: {gib(named)} of temporaries")
    return program_cost(name, compiled, chip, **kw)


def _calls_and_tokens(cfg: ConfigDict, name: str, plan: PassPlan, max_len: int) -> tuple[int, int, bool]:
    """(calls per step, tokens per call over all shards, whether one call loops over micro-batches)."""
    d = cfg.derived
    dp = int(d.dp_size)
    repeat = 1
    if name == "update_actor":
        repeat = int(d.actor_num_mini_batches) * int(cfg.actor_rollout_ref.actor.ppo_epochs)
    elif name == "update_critic":
        repeat = int(d.critic_num_mini_batches) * int(cfg.critic.ppo_epochs)
    if plan.packed:
        whole = -(-plan.seqs_per_shard * max_len // plan.row_len)
        per_batch = -(-whole // plan.rows_per_micro)
        return per_batch * repeat, dp * plan.rows_per_micro * plan.row_len, False
    return repeat, dp * plan.seqs_per_shard * max_len, plan.num_micro > 1
