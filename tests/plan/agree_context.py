"""One process of a multi-process run choosing ``mesh.context=0`` (automatic), each process with its own usable
memory as each host measures its own (argv[1]: bytes per device, 0 for plenty). Prints the choice, or the one
error line, as ``main`` does; run by tests/plan/test_context_plan.py as two processes over gloo."""

from __future__ import annotations

import sys


def main(usable: int) -> int:
    from rlhf_jax.parallel.distributed import maybe_initialize

    maybe_initialize()
    from rlhf_jax.plan.context import choose_context
    from tests.train.helpers import load_recipe

    cfg = load_recipe("grpo")
    cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n = 8, 2
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.context = -1, 1, 0
    try:
        context, _ = choose_context(cfg, usable_bytes=usable or 2**40)
    except MemoryError as e:
        print(f"error: {str(e).splitlines()[0]}", flush=True)
        return 2
    print(f"context {context}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
