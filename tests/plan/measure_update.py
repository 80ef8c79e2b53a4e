"""Run in a fresh process (one CPU device): the plan's per-device total for the actor update pass of a GRPO run on
the model at ``argv[1]``, then the same pass run for real on zero weights of that shape, its peak memory measured.

Prints one JSON line {"predicted": bytes, "measured": bytes, "micro": "..."}. XLA:CPU reports no allocator
statistics, so the measurement is the process's peak resident memory (VmHWM, reset through /proc/self/clear_refs)
above its resident memory just before the pass's arrays exist; large buffers are mmapped and returned on free, so
the baseline holds only the interpreter and libraries. The weights are zeros (their memory is what counts).
"""

from __future__ import annotations

import ctypes
import json
import sys


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def zero_model(config, mesh, rules):
    """The model with every parameter zero, created in its sharded layout by one program of broadcasts: the memory
    of random weights without compiling their initialisers (a SmolLM2 random init compiles for ~15 s)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rlhf_jax.models import TASK_CAUSAL_LM
    from rlhf_jax.models.hf_import import build_abstract
    from rlhf_jax.models.sharding import variable_sharding

    graphdef, abstract = nnx.split(build_abstract(config, TASK_CAUSAL_LM))
    shardings = jax.tree.map(lambda v: variable_sharding(v, mesh, rules), abstract,
                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    state = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def main(model_dir: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rlhf_jax.config import base_config
    from rlhf_jax.plan import plan_run
    from rlhf_jax.plan import programs as pg
    from rlhf_jax.plan.run import finalized
    from rlhf_jax.train.engine import Role
    from rlhf_jax.train.optim import make_optimizer
    from rlhf_jax.types import TrainBatch

    cfg = base_config()
    cfg.actor_rollout_ref.model.path = model_dir
    cfg.data.train_files = ("builtin:arithmetic",)
    cfg.data.max_prompt_length, cfg.data.max_response_length = 128, 128
    cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n = 4, 4
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    cfg.algorithm.adv_estimator, cfg.critic.enable = "grpo", False
    cfg.actor_rollout_ref.actor.use_kl_loss = False  # no reference: the resident arrays are the actor's alone
    cfg.trainer.total_training_steps = 1
    plan = plan_run(cfg, "local", sampler=False)  # the update alone is measured: no sampler to compile
    cost = next(p for p in plan.programs if p.name == "update_actor")
    predicted = cost.peak_bytes
    print(cost, plan.resident_bytes, file=sys.stderr)
    micro = plan.passes["update_actor"]

    # The same pass for real: the plan's own builders over concrete arrays of the same shapes.
    cfg = finalized(cfg, 1, 1)
    run = pg.build_run(cfg, jax.devices())
    compiled = pg.compile_training_pass(run, "update_actor", run.actor, micro)
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    model = zero_model(run.actor.config, run.mesh, run.rules)
    tx, _ = make_optimizer(cfg.actor_rollout_ref.actor.optim, 1.0, 1, 1)
    actor = Role(model, run.mesh, tx)
    args = [actor.params, actor.frozen, jax.tree.map(jnp.zeros_like, actor.params)]
    from rlhf_jax.train.packed_steps import LOGIT_KEYS, ROW_KEYS

    rows, row_len = micro.rows_per_micro, micro.row_len
    grid_rows = int(cfg.derived.actor_mini_batch_size)
    R = int(cfg.actor_rollout_ref.rollout.response_length)
    micro_batch = {k: np.zeros((rows, row_len), np.int32) for k in ROW_KEYS}
    micro_batch.update({k: np.zeros((rows * row_len,), np.int32) for k in LOGIT_KEYS})
    grid = TrainBatch(response_mask=np.ones((grid_rows, R), np.int32),
                      old_log_probs=np.zeros((grid_rows, R), np.float32), advantages=np.ones((grid_rows, R), np.float32))
    out = compiled(*args, micro_batch, grid, jax.random.key(0))
    jax.block_until_ready(out)
    measured = _status("VmHWM") - before
    print(json.dumps({"predicted": predicted, "measured": measured, "micro": f"{rows} x {row_len}"}))


if __name__ == "__main__":
    main(sys.argv[1])
