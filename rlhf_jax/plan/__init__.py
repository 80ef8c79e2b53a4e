"""Will a run fit, and where will its time go: every program of the run compiled for a TPU slice or a GPU node
without the hardware (``python -m rlhf_jax.plan --config=... --topology=v5p-8``), with XLA's memory and cost
analyses, the memory plan's micro-batches and a roofline step estimate."""

import importlib

# Each public name and its module, imported on first use: ``report`` and ``targets`` (what a benchmark on an offline
# accelerator machine reads) then import without ml_collections, which ``run`` needs for configs.
_EXPORTS = {
    "ProgramCost": "rlhf_jax.plan.report", "format_table": "rlhf_jax.plan.report", "program_cost": "rlhf_jax.plan.report",
    "RunPlan": "rlhf_jax.plan.run", "plan_run": "rlhf_jax.plan.run",
    "CHIPS": "rlhf_jax.parallel.chips", "Chip": "rlhf_jax.parallel.chips", "chip_of": "rlhf_jax.parallel.chips",
    "TARGETS": "rlhf_jax.plan.targets", "Target": "rlhf_jax.plan.targets", "target": "rlhf_jax.plan.targets",
    "target_devices": "rlhf_jax.plan.targets",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlhf_jax.plan' has no attribute {name!r}")


__all__ = ["CHIPS", "TARGETS", "Chip", "ProgramCost", "RunPlan", "Target", "chip_of", "format_table", "plan_run",
           "program_cost", "target", "target_devices"]
