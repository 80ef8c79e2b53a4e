"""Will a run fit, and where will its time go: every program of the run compiled for a TPU slice or a GPU node
without the hardware (``python -m rlhf_jax.plan --config=... --topology=v5p-8``), with XLA's memory and cost
analyses, the memory plan's micro-batches and a roofline step estimate."""

from rlhf_jax.plan.report import ProgramCost, format_table, program_cost
from rlhf_jax.plan.run import RunPlan, plan_run
from rlhf_jax.parallel.chips import CHIPS, Chip, chip_of
from rlhf_jax.plan.targets import TARGETS, Target, target, target_devices

__all__ = ["CHIPS", "TARGETS", "Chip", "ProgramCost", "RunPlan", "Target", "chip_of", "format_table", "plan_run",
           "program_cost", "target", "target_devices"]
