"""The same GRPO step on 1 CPU device and on 8 fake devices (data=2, fsdp=2, tensor=2) gives the same result."""

import os

import numpy as np
import pytest

from rlhf_jax.models.safetensors_io import LazyFile
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import cli_args, make_config, read_metrics, run_main


def _settings(mesh: tuple[int, int, int]) -> dict:
    return {"trainer.total_training_steps": 1, "trainer.save_hf_checkpoint": "last",
            "mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2],
            # One mini-batch of all 8 sequences, accumulated over micro-batches of 1 per shard.
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4}


def _outputs(out: str) -> tuple[dict, LazyFile]:
    return read_metrics(out)[0], LazyFile(os.path.join(out, "hf", "global_step_1", "model.safetensors"))


def test_grpo_step_same_on_one_and_eight_devices(tmp_path):
    # One device needs a process of its own; the test process has the 8 devices the other run takes.
    one_dir, eight_dir = str(tmp_path / "one"), str(tmp_path / "eight")
    proc = run_main(cli_args(one_dir, **_settings((1, 1, 1))), devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    Trainer(make_config(eight_dir, **_settings((2, 2, 2)))).fit()
    (one, one_params), (eight, eight_params) = _outputs(one_dir), _outputs(eight_dir)
    # Same samples (the sampler's randomness does not depend on the mesh), same rewards.
    assert one["critic/score/mean"] == eight["critic/score/mean"]
    assert one["response_length/mean"] == eight["response_length/mean"]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        assert eight[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    assert one["actor/grad_norm"] > 0
    for name in one_params.keys():
        np.testing.assert_allclose(eight_params.get(name), one_params.get(name), atol=1e-5, err_msg=name)
