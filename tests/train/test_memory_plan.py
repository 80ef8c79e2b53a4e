"""The memory plan: XLA's estimate of each training pass, read before the first step, on the real SmolLM2.

A micro-batch the user set too large stops the run before any sampling with a message naming
the key; left automatic (-1), the same shape is sized down to what the estimate fits.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax

from rlhf_jax.batch.packing import row_length
from rlhf_jax.config.validate import finalize
from rlhf_jax.runtime.oom import memory_hint
from rlhf_jax.train.passes import (HEADROOM, compiled_bytes, fit_pass, free_device_memory, plan_passes,
                                   preferred_grad_tokens)
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config

# 128 sequences of up to 32 + 96 tokens: 32 per shard, about 4k packed tokens per shard, several GiB of float32
# activations per device for the actor update, more than a CPU device's share of this machine's memory; one
# packed row of 128 tokens needs well under it.
BIG = {
    "data.max_prompt_length": 32, "data.max_response_length": 96, "data.train_batch_size": 32,
    "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
    "data.prompt_template": "raw", "data.train_files": ("builtin:arithmetic?max_value=4&train_size=64",),
}


def _trainer(tmp_path, smollm2_dir, **overrides) -> Trainer:
    cfg = make_config(str(tmp_path), **{"actor_rollout_ref.model.path": smollm2_dir, **BIG, **overrides})
    return Trainer(cfg)


def test_an_automatic_micro_batch_is_sized_to_fit(tmp_path, smollm2_dir):
    trainer = _trainer(tmp_path, smollm2_dir, **{"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": -1})
    try:
        start = trainer.plans["update_actor"]
        # An accelerator's automatic size starts from the whole per-shard mini-batch; that does not fit here.
        whole_rows = -(-start.seqs_per_shard * trainer.cfg.derived.max_seq_len // start.row_len)
        whole = dataclasses.replace(start, rows_per_micro=whole_rows)
        # Free memory set to 60 % of what the whole needs, not read from the host: the host's free memory moves
        # with whatever else runs, and the sizing logic is what is tested here.
        compile_update = functools.lru_cache(maxsize=None)(lambda p: trainer.compile_pass("update_actor", p))
        whole_need = compiled_bytes(compile_update(whole))
        free = int(0.6 * whole_need)
        hint = memory_hint(trainer.cfg, "actor")
        plan, need = fit_pass(whole, compile_update, free, hint)
        assert plan.auto and 1 <= plan.rows_per_micro < whole_rows
        assert need <= HEADROOM * free
        print(f"automatic update micro-batch: {plan.rows_per_micro} of {whole_rows} rows, {need / 2**30:.2f} GiB per device")
        # The trainer's own starting size (on CPU: cache-sized) fits the host's free memory as the plan finds it.
        own, own_need = fit_pass(start, compile_update, free_device_memory(), hint)
        assert own.auto and own.rows_per_micro <= start.rows_per_micro
        assert own_need <= HEADROOM * free_device_memory() * 1.05
    finally:
        trainer.close()


def _finalized(tmp_path, packed: bool, micro: int):
    cfg = make_config(str(tmp_path), **BIG, **{"actor_rollout_ref.model.use_remove_padding": packed,
                                               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro})
    return finalize(cfg, num_devices=jax.device_count(), check_paths=False)


def test_automatic_gradient_micro_batches_are_cache_sized_on_cpu_and_whole_on_accelerators(tmp_path):
    mlp = 1536  # SmolLM2's MLP width
    tokens = preferred_grad_tokens(mlp, "cpu")
    assert tokens == 512 and preferred_grad_tokens(mlp, "gpu") is None and preferred_grad_tokens(mlp, "tpu") is None
    for packed in (True, False):
        cfg = _finalized(tmp_path, packed, -1)
        d = cfg.derived
        cpu = plan_passes(cfg, actor_mlp_width=mlp, backend="cpu")
        gpu = plan_passes(cfg, actor_mlp_width=mlp, backend="gpu")
        per_shard = int(d.actor_mini_batch_size_per_shard)
        if packed:
            row_len = row_length(int(d.max_seq_len))
            assert cpu["update_actor"].rows_per_micro == tokens // row_len
            assert gpu["update_actor"].rows_per_micro == -(-per_shard * int(d.max_seq_len) // row_len)
        else:
            assert cpu["update_actor"].rows_per_micro == tokens // int(d.max_seq_len)
            assert per_shard % cpu["update_actor"].rows_per_micro == 0
            assert gpu["update_actor"].rows_per_micro == per_shard
        assert cpu["ref"] == gpu["ref"]  # forward passes are not cache-bound: the whole batch on every backend
        # A size the user sets is kept on every backend.
        cfg = _finalized(tmp_path, packed, 16)
        assert (plan_passes(cfg, actor_mlp_width=mlp, backend="cpu")["update_actor"]
                == plan_passes(cfg, actor_mlp_width=mlp, backend="gpu")["update_actor"])


def test_a_micro_batch_that_cannot_fit_stops_before_the_first_step_in_one_line(tmp_path, smollm2_dir):
    from tests.train.helpers import cli_args, run_main

    key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    proc = run_main(cli_args(str(tmp_path), **{"actor_rollout_ref.model.path": smollm2_dir, **BIG, key: 32}))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and key in errors[0], proc.stderr[-2000:]
    assert "enable_gradient_checkpointing" in errors[0]  # the other way to make room
    # stopped before the first step: nothing sampled, trained or logged
    metrics = os.path.join(str(tmp_path), "metrics.jsonl")
    assert not os.path.exists(metrics) or os.path.getsize(metrics) == 0
    assert "step 1" not in proc.stdout + proc.stderr
