"""The plan of a run with mesh.context reads the split: the sampler's per-device memory falls with it.

Two plans of the tiny GRPO recipe with 512-token sequences compiled for a v5e-8 slice, four data-parallel shards
each, one sequence per micro-batch: context 1 (four training devices; the sampler gets the other four) and context 2
(all eight). The sampler's temporaries per device (XLA's memory analysis of the compiled rollout) fall: its decode
cache is split along its length.
"""

import pytest

from rlhf_jax.plan import plan_run
from tests.train.helpers import load_recipe


def _plan(context: int):
    cfg = load_recipe("grpo")
    cfg.data.max_prompt_length = 16
    cfg.data.max_response_length = 496
    cfg.data.train_batch_size = 4
    cfg.actor_rollout_ref.rollout.n = 2
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 1
    cfg.actor_rollout_ref.actor.use_kl_loss = False  # no reference pass: the update alone
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.context = 4, 1, context
    cfg.mesh.rollout_devices = 0 if context == 2 else 4
    plan = plan_run(cfg, "v5e-8")
    return {p.name: p for p in plan.programs}


def test_the_sampler_needs_less_per_device_with_context_2():
    whole, split = _plan(1), _plan(2)
    assert "update_actor" in whole and "update_actor" in split
    # 2 slots per shard x 2 layers x keys and values x 2 kv heads x 16 x 512 columns x 4 bytes: 0.5 MiB, halved
    cache = 2 * 2 * 2 * 2 * 16 * 512 * 4
    assert whole["sampler"].temp_bytes - split["sampler"].temp_bytes >= cache / 2 * 0.5, (whole["sampler"],
                                                                                        split["sampler"])
