"""An out-of-memory that happens during training anyway (the memory plan stops before the
first step for sizes that XLA's estimate says cannot fit): one line naming the keys that lower memory.

XLA reports a failed device (or XLA:CPU host) allocation as a runtime error whose message starts with
``RESOURCE_EXHAUSTED``; NumPy and Python raise ``MemoryError`` when the host runs out.
"""

from __future__ import annotations


def memory_hint(cfg, role: str) -> str:
    """The other levers that lower a pass's memory, for the error message."""
    model = cfg.critic.model if role == "critic" else cfg.actor_rollout_ref.model
    prefix = "critic.model" if role == "critic" else "actor_rollout_ref.model"
    parts = []
    if not model.enable_gradient_checkpointing:
        parts.append(f"set {prefix}.enable_gradient_checkpointing=True")
    if cfg.actor_rollout_ref.model.compute_dtype == "float32":
        parts.append("use actor_rollout_ref.model.compute_dtype=bfloat16")
    parts.append("or shard over more devices (mesh.fsdp)")
    return ", ".join(parts)


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error).split("\n", 1)[0]


def out_of_memory_message(error: BaseException, *, step: int, size_keys: tuple[str, ...], hint: str,
                          checkpoint_steps: list[int], checkpoint_dir: str) -> str | None:
    """The one-line report of ``error`` when it is an out-of-memory in training step ``step`` + 1, else None.
    ``size_keys``: the keys that size the planned passes' micro-batches; ``hint``: the other levers
    (``memory_hint``); the checkpoints on disk say where the same command resumes."""
    if not is_out_of_memory(error):
        return None
    cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    keys = sorted(set(size_keys))
    lower = f"lower {' / '.join(keys)} (or set them to -1 to size them automatically), " if keys else ""
    kept = (f"the checkpoint of step {checkpoint_steps[-1]} in {checkpoint_dir} is intact and the same command "
            "resumes from it" if checkpoint_steps else "no checkpoint was saved yet")
    return f"out of memory in training step {step + 1} ({cause}): {lower}{hint}; {kept}"
