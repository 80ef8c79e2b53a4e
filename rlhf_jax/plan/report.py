"""One compiled program's memory, FLOPs, bytes and roofline time on a chip, and the plan's table.

Memory comes from XLA's ``memory_analysis()`` of the executable compiled for the target (per device). FLOPs and
bytes accessed come from ``cost_analysis()`` (per device) where XLA gives them and the program has no loop whose
trip count XLA cannot know; otherwise from the model's arithmetic (``arithmetic.py``), and the table says which.
The roofline time of a call is max(FLOPs / peak FLOP/s, bytes / bandwidth) on one device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlhf_jax.parallel.chips import Chip

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """Per device and per call unless named otherwise."""

    name: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int  # what the device holds while the program runs: its arguments, outputs and temporaries, plus the
    # run's other resident arrays (parameters, optimizer state of roles the program does not take)
    flops: float | None
    bytes_accessed: float | None
    source: str  # "xla" (cost_analysis) or "model" (arithmetic.py)
    calls: int  # calls per training step
    roofline_s: float | None  # all calls of a step
    note: str = ""

    @property
    def program_bytes(self) -> int:
        """argument + output + temp - alias: the program's own footprint."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def memory_of(compiled: Any) -> tuple[int, int, int, int]:
    """(argument, output, temp, alias) bytes per device of a compiled executable (zeros when XLA gives none)."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without it
        ma = None
    if ma is None:
        return 0, 0, 0, 0
    return (int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes), int(ma.temp_size_in_bytes),
            int(ma.alias_size_in_bytes))


def xla_cost(compiled: Any) -> tuple[float, float] | None:
    """(FLOPs, bytes accessed) per device from XLA's cost analysis; None where the backend gives none (GPU)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"]), float(cost.get("bytes accessed", 0.0))


def roofline(chip: Chip | None, flops: float | None, nbytes: float | None) -> float | None:
    if chip is None or flops is None:
        return None
    return max(flops / chip.peak_flops, (nbytes or 0.0) / chip.hbm_bytes_per_s)


def program_cost(name: str, compiled: Any, chip: Chip | None, *, calls: int = 1, model_flops: float | None = None,
                 model_bytes: float | None = None, looped: bool = False, resident_bytes: int = 0,
                 resident_arg_bytes: int = 0, note: str = "") -> ProgramCost:
    """The cost of ``compiled`` run ``calls`` times a step. ``model_flops`` / ``model_bytes``: the arithmetic's per
    device figures, used where XLA gives none or ``looped`` (XLA counts a loop body once). ``resident_bytes``: the
    run's resident arrays per device; ``resident_arg_bytes``: the part of them that the program takes as arguments."""
    arg, out, temp, alias = memory_of(compiled)
    cost = None if looped else xla_cost(compiled)
    if cost is not None:
        flops, nbytes, source = cost[0], cost[1], "xla"
    else:
        flops, nbytes, source = model_flops, model_bytes, "model"
    one = roofline(chip, flops, nbytes)
    peak = resident_bytes + arg - resident_arg_bytes + out + temp - alias
    return ProgramCost(name, arg, out, temp, alias, peak, flops, nbytes, source, calls,
                       None if one is None else one * calls, note)


def _g(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _t(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_table(plan) -> str:
    """The plan (``RunPlan``) as one table and a summary; GiB are per device."""
    head = (f"{'program':<16}{'args':>8}{'out':>8}{'temp':>8}{'peak':>8}  {'of':>6}  {'TFLOP':>9}  {'GB':>8}  "
            f"{'src':<5}{'calls':>6}  {'roofline':>10}  note")
    lines = [f"plan for {plan.target.name} ({plan.devices} x {plan.target.chip.name}, {plan.usable_bytes / GIB:.1f} "
             f"GiB usable each): {plan.model_name}, {plan.params / 1e9:.2f} B parameters", head, "-" * len(head)]
    for p in plan.programs:
        lines.append(
            f"{p.name:<16}{_g(p.argument_bytes):>8}{_g(p.output_bytes):>8}{_g(p.temp_bytes):>8}{_g(p.peak_bytes):>8}  "
            f"{p.peak_bytes / plan.usable_bytes:>6.0%}  "
            f"{'-' if p.flops is None else f'{p.flops / 1e12:.3g}':>9}  "
            f"{'-' if p.bytes_accessed is None else f'{p.bytes_accessed / 1e9:.3g}':>8}  {p.source:<5}{p.calls:>6}  "
            f"{_t(p.roofline_s):>10}  {p.note}")
    lines.append(f"resident per device: {_g(plan.resident_bytes)} GiB (parameters, optimizer state, reference, critic)")
    if plan.host_bytes:
        lines.append(f"in host memory per device: {_g(plan.host_bytes)} GiB (offloaded parameters and optimizer state, "
                     "copied to the devices inside each program that reads them)")
    lines.append("micro-batches: " + "; ".join(f"{k} {v}" for k, v in plan.micro_batches.items()))
    verdict = "fits" if plan.fits else "does NOT fit"
    split = (f"sampling {_t(plan.sampling_s)} + training {_t(plan.training_s)} (every response at full length; "
             if getattr(plan, "samples", True) else "all training, no sampler (every sequence at full length; ")
    lines.append(f"{verdict}: peak {_g(plan.peak_bytes)} of {_g(plan.usable_bytes)} GiB per device; roofline step "
                 f"{_t(plan.step_s)} = {split}FLOPs/bytes per device, 'model' = the model's arithmetic)")
    return "\n".join(lines)
