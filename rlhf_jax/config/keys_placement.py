"""Schema keys of where the work runs: the JAX-specific ``mesh`` section (axes, sampling devices or processes of
their own, the sharding rules) and the ``experience`` schedule (sampled ahead, overlapped, partial rollouts)."""

from __future__ import annotations

from rlhf_jax.config.key import Check, Key, at_least
from rlhf_jax.config.names import CONTEXT_ATTENTION

MESH_AXES = ("data", "fsdp", "tensor", "expert", "context")


def _axis_rules_problem(rules: tuple) -> str | None:
    seen = set()
    for rule in rules:
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            return f"mesh.logical_axis_rules: each rule is (logical_name, mesh_axes), got {rule!r}"
        name, axes = rule
        if name in seen:
            return f"mesh.logical_axis_rules: logical axis {name!r} appears twice"
        seen.add(name)
        for ax in () if axes is None else (axes,) if isinstance(axes, str) else axes:
            if ax not in MESH_AXES:
                return f"mesh.logical_axis_rules: {name!r} -> {ax!r} is not a mesh axis ({', '.join(MESH_AXES)})"
    return None


AXIS_RULES = Check(lambda v: _axis_rules_problem(v) is None, ": (logical name, mesh axes) pairs over the mesh's "
                   "axes, each name once", _axis_rules_problem)


MESH = (
    Key("mesh.data", -1, "Devices on the pure data-parallel axis; -1 = the devices left over."),
    Key("mesh.fsdp", 1, "Devices on the fully-sharded data-parallel axis (parameters sharded); -1 = the rest."),
    Key("mesh.tensor", 1, "Devices on the tensor-parallel axis (heads, mlp, vocab sharded); -1 = the rest."),
    Key("mesh.expert", 1,
        "Devices on the expert-parallel axis (a MoE model's experts split over it); the batch is split over it "
        "too, like data. -1 = the rest."),
    Key("mesh.context", 0,
        "Devices splitting each sequence of the training passes (mesh.context_attention). 0 = automatic: the "
        "smallest split that fits, planned at start (docs/placement.md); -1 = the rest."),
    Key("mesh.context_attention", "auto",
        "Attention under mesh.context > 1: ulysses (heads split over tensor x context; they must divide), gather "
        "(keys/values all-gathered over context), auto (ulysses where the heads divide, else gather).",
        choices=CONTEXT_ATTENTION),
    Key("mesh.rollout_devices", 0, "Sample on this many devices of their own (the last ones; their own data-parallel "
        "mesh) while the other devices train; the actor's weights move there after each update. 0 = every device does both."),
    Key("mesh.rollout_processes", 0, "Sample on the last k processes while the others train (in the experience.* "
        "schedule; batches and weights move device to device; docs/placement.md). 0 = every process does both."),
    Key("mesh.handoff_timeout_s", 1800.0, "With mesh.rollout_processes: the longest wait for the other side's "
        "weights or batch before the run stops, naming the process and the transfer.", type=float),
    Key("mesh.logical_axis_rules",
        (("batch", ("data", "fsdp", "expert")), ("length", "context"), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"),
         ("kv_heads", "tensor"), ("vocab", "tensor"), ("expert", "expert")),
        "(logical axis name, mesh axis or axes or None) pairs; names not listed are replicated.", check=AXIS_RULES),
)

EXPERIENCE = (
    Key("experience.buffer_size", 1,
        "Rollout batches sampled with one set of weights, then trained on one per step, oldest first (batch i of "
        "a round trains i updates after its weights); untrained ones are saved with checkpoints.",
        check=at_least(1, " (1 = train on each batch as it is sampled)")),
    Key("experience.overlap", False,
        "Sample the next round on mesh.rollout_devices or mesh.rollout_processes while the current one trains: a "
        "batch trains 1 update after its weights (K to 2K-1 with buffer_size K)."),
    Key("experience.max_staleness", None,
        "Largest lag (updates between a batch's sampling weights and its training) the run may have; the "
        "buffer size and overlap must stay within it. None = no bound; 0 = strictly on-policy.", type=int,
        check=at_least(0, " (0 = strictly on-policy) or None")),
    Key("experience.partial_rollout_tokens", 0,
        "Partial rollouts (mesh.rollout_processes): sample this many tokens at a time; an update arriving meanwhile "
        "is taken at the next boundary (docs/placement.md). 0 = whole responses.", check=at_least(0, " (0 = off)")),
    Key("experience.partial_rollout_wait", False,
        "Partial rollouts wait for the update at each batch's first segment boundary: a fixed swap point, so runs "
        "repeat exactly; False = take it when it arrives."),
)
