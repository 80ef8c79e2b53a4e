"""The programs of a supervised run (``algorithm.type`` sft or dpo), built by the trainers' own builders over
abstract parameters on a target's devices.

SFT (train/sft.py): the step at the trainer's layout (``sft_pass_plan``) for the widest batch its loader can give
(``widest_batch``): padded, one program over the batch's micro-batches; packed, one program a micro-batch (the
largest the packer lays out, every position's logits) and the optimizer step over the accumulated gradients. The
validation loss pass (``data.val_files`` with ``data.val_batch_size``) is its own program.
DPO (train/dpo.py): the reference's log-prob pass (one side of the pairs a call, two calls a step) and the update
(``update_program``) at the data's longest widths the config allows; with validation pairs, the policy's and the
reference's forward passes over a validation batch.
There is no sampler: a step is all training.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from ml_collections import ConfigDict

from rlhf_jax.batch.packing import row_buckets
from rlhf_jax.models import TASK_CAUSAL_LM
from rlhf_jax.plan import arithmetic as ar
from rlhf_jax.plan import programs as pg
from rlhf_jax.plan.abstract import hf_config
from rlhf_jax.train import dpo, losses, sft
from rlhf_jax.train.engine import Role
from rlhf_jax.train.passes import PassPlan, per_device_bytes
from rlhf_jax.types import TrainBatch

KINDS = ("sft", "dpo")
A = "actor_rollout_ref."
SFT_KEYS = "data.micro_batch_size_per_gpu (-1 = the whole per-shard batch at once), data.max_length"
LENGTH_KEYS = "data.max_prompt_length / max_response_length"


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of a supervised run, ready to compile."""

    name: str
    compile: Callable[[], Any]
    held: int  # per-device bytes of the run's resident arrays it takes as arguments
    calls: int  # per training step (per validation batch for a validation pass)
    looped: bool  # one call loops over micro-batches (XLA's cost analysis counts the body once)
    flops: float | None  # the model's arithmetic, per device and call
    nbytes: float  # parameter (and optimizer state) bytes a call reads and writes, per device
    keys: str  # what to lower when it does not fit
    note: str
    in_step: bool = True  # counted in the step's roofline time (validation is not)


@dataclasses.dataclass
class SupervisedRun:
    cfg: ConfigDict  # finalized for the target's device count
    hf: dict  # the policy's config.json
    mesh: Any
    actor: Role
    ref: Role | None
    passes: dict[str, PassPlan]  # the micro-batch layouts, for the table
    programs: list[Program]
    critic: None = None  # the resident arrays are counted as for an RL run, which may have one


def largest_micro(plan: PassPlan) -> int:
    """Rows per shard of the largest packed micro-batch the packer lays out (``batch/packing.micro_layout``): at most
    ``plan.rows_per_micro``, and at most the bucket holding each of a shard's sequences in a row of its own."""
    cap = plan.rows_per_micro
    return cap if plan.seqs_per_shard >= cap else next(b for b in row_buckets(cap) if b >= plan.seqs_per_shard)


def padded_rows(batch: int, multiple: int, processes: int) -> int:
    """Rows of a validation batch of ``batch`` examples over all processes, each padding its share to
    ``multiple`` rows."""
    share = -(-batch // processes)
    return processes * -(-share // multiple) * multiple


def build(cfg: ConfigDict, devices: list, processes: int) -> SupervisedRun:
    """The abstract policy (and reference) and the programs of the finalized supervised ``cfg`` on ``devices``."""
    hf = hf_config(cfg.actor_rollout_ref.model.path)
    if cfg.algorithm.type == "sft":
        if cfg.mesh.rollout_devices:  # as train/sft.prepare_sft refuses it
            raise ValueError("mesh.rollout_devices: SFT samples only for validation, on the training mesh; set it "
                             "to 0")
        sft.check_context(cfg, hf)
    mesh, _, rules = pg.meshes(cfg, devices)
    if cfg.algorithm.type == "sft":
        return _sft(cfg, hf, mesh, rules, processes)
    return _dpo(cfg, hf, mesh, rules, processes)


def _reads(role: Role, tensor: int, update: bool) -> float:
    """Parameter bytes a call reads per device (an update also writes them and reads and writes the moments)."""
    total = float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(role.state()))) / tensor
    return total * (3 if update else 1)


def _flops(role: Role, sequences: int, length: int, n: int, update: bool) -> float:
    multiplier = ar.training_multiplier(role.config.remat) if update else 1.0
    return ar.sequence_flops(ar.ModelShape.of(role.config), sequences, length) * multiplier / n


def _sft(cfg: ConfigDict, hf: dict, mesh, rules, processes: int) -> SupervisedRun:
    actor = pg.abstract_actor(cfg, hf, mesh, rules, TASK_CAUSAL_LM, 1)  # one optimizer step a batch
    plan = sft.sft_pass_plan(cfg)
    P, R = sft.widest_batch(cfg)
    dp, n, tensor = int(cfg.derived.dp_size), mesh.devices.size, int(cfg.derived.mesh_shape[2])
    rows = int(cfg.data.train_batch_size)
    batch = TrainBatch.abstract(rows, P, R, ())
    trained = per_device_bytes([actor.params, actor.frozen])
    if plan.packed:
        micro = largest_micro(plan)
        shape, cells = (dp * micro, plan.row_len), dp * micro * plan.row_len
        calls = -(-plan.seqs_per_shard // micro)  # at most: every sequence in a row of its own
        programs = [
            Program("sft", lambda: actor.packed_grads_program(losses.SFT, shape, cells, batch.grid(), dp), trained,
                    calls, False, _flops(actor, dp * micro, plan.row_len, n, True), _reads(actor, tensor, True),
                    SFT_KEYS, f"{micro} packed rows x {plan.row_len} tokens a micro-batch per shard, "
                              f"at most {calls} a step"),
            Program("sft_apply", actor.apply_grads_program, per_device_bytes([actor.params, actor.opt_state]), 1,
                    False, 0.0, _reads(actor, tensor, True), f"{A}model.lora_rank, mesh.fsdp",
                    "the optimizer step over the accumulated gradients")]
    else:
        programs = [Program("sft", lambda: actor.padded_program(losses.SFT, batch, n_micro=plan.num_micro), trained,
                            1, plan.num_micro > 1, _flops(actor, rows, P + R, n, True), _reads(actor, tensor, True),
                            SFT_KEYS, f"{plan.num_micro} micro-batch(es) of {plan.rows_per_micro} sequences of "
                                      f"{P} + {R} tokens per shard")]
    passes = {"sft": dataclasses.replace(plan, rows_per_micro=largest_micro(plan)) if plan.packed else plan}
    val = int(cfg.data.val_batch_size or 0)
    if cfg.data.val_files and val:  # without val_batch_size a validation batch is the whole set (its size unknown)
        val_rows = padded_rows(val, sft.validation_rows(cfg, processes), processes)
        n_val = sft.validation_micro_batches(cfg, val_rows // processes, processes)
        inputs = TrainBatch.abstract(val_rows, P, R, ()).sequences()
        programs.append(Program(
            "validation", lambda: actor.padded_program("logp", inputs, n_micro=n_val, temperature=1.0),
            per_device_bytes(actor.state()), 1, n_val > 1, _flops(actor, val_rows, P + R, n, False),
            _reads(actor, tensor, False), "data.val_batch_size, data.micro_batch_size_per_gpu",
            f"val/loss: {val_rows} sequences of {P} + {R} tokens a batch, {n_val} micro-batch(es); not in the step",
            in_step=False))
    return SupervisedRun(cfg, hf, mesh, actor, None, passes, programs)


def _dpo(cfg: ConfigDict, hf: dict, mesh, rules, processes: int) -> SupervisedRun:
    d = cfg.derived
    actor = pg.abstract_actor(cfg, hf, mesh, rules, TASK_CAUSAL_LM, d.actor_updates_per_step)
    ref = pg.abstract_reference(cfg, hf, actor, mesh, rules)
    spec = dpo.dpo_spec(cfg)
    widths = dpo.pair_widths(cfg, int(cfg.data.max_prompt_length), int(cfg.data.max_response_length))
    length, n, tensor = sum(widths), mesh.devices.size, int(d.mesh_shape[2])
    pairs, mini, n_ref, n_update = (int(cfg.data.train_batch_size), int(d.actor_mini_batch_size),
                                    int(d.ref_micro_batches), int(d.actor_grad_accum_steps))
    side = TrainBatch.abstract(pairs, *widths, ()).sequences()  # one side of the pairs: the ordinary log-prob pass
    programs = [
        Program("ref", lambda: ref.padded_program("logp", side, n_micro=n_ref, temperature=1.0),
                per_device_bytes(ref.state()), 2, n_ref > 1, _flops(ref, pairs, length, n, False),
                _reads(ref, tensor, False), f"{A}ref.log_prob_micro_batch_size_per_gpu, {LENGTH_KEYS}",
                f"reference log-probs of {pairs} pairs, one side a call"),
        Program("dpo_update", lambda: dpo.update_program(actor, cfg, spec, widths),
                per_device_bytes([actor.params, actor.frozen]), int(d.actor_num_mini_batches), n_update > 1,
                _flops(actor, 2 * mini, length, n, True), _reads(actor, tensor, True),
                f"{A}actor.ppo_micro_batch_size_per_gpu, {LENGTH_KEYS}",
                f"{mini} pairs a mini-batch, {n_update} micro-batch(es) of "
                f"{int(d.actor_mini_batch_size_per_shard) // n_update} pairs per shard")]
    dp = int(d.dp_size)
    passes = {"ref": PassPlan("ref", False, length, pairs // dp // n_ref, pairs // dp,
                              (f"{A}ref.log_prob_micro_batch_size_per_gpu",), False),
              "dpo_update": PassPlan("dpo_update", False, length, mini // dp // n_update, mini // dp,
                                     (f"{A}actor.ppo_micro_batch_size_per_gpu",), False)}
    val = int(cfg.data.val_batch_size or 0)
    if cfg.data.val_files and val:  # the policy's and the reference's sequence log-probs, one micro-batch
        rows = padded_rows(val, dpo.validation_rows(cfg, processes), processes)
        inputs = TrainBatch.abstract(rows, *widths, ()).sequences()
        for name, role in (("val_policy", actor), ("val_ref", ref)):
            programs.append(Program(
                name, lambda role=role: role.padded_program("logp", inputs, n_micro=1, temperature=1.0),
                per_device_bytes(role.state()), 2, False, _flops(role, rows, length, n, False),
                _reads(role, tensor, False), f"data.val_batch_size, {LENGTH_KEYS}",
                f"{rows} pairs a validation batch, one side a call; not in the step", in_step=False))
    return SupervisedRun(cfg, hf, mesh, actor, ref, passes, programs)

