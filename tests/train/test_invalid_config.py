"""Impossible settings stop before anything is built or compiled, with a message naming the key."""

import pytest

from rlhf_jax.train.setup import prepare
from tests.train.helpers import cli_args, make_config, run_main

CASES = [
    ({"data.train_batch_size": 6, "actor_rollout_ref.actor.ppo_mini_batch_size": 4}, r"ppo_mini_batch_size"),
    ({"algorithm.adv_estimator": "grpoo"}, r"algorithm\.adv_estimator.*grpo"),
    ({"data.max_prompt_length": 500, "data.max_response_length": 100}, r"max_position_embeddings|max_prompt_length"),
    ({"data.train_files": ("/nonexistent/train.parquet",)}, r"data\.train_files.*nonexistent"),
    ({"actor_rollout_ref.actor.policy_loss.loss_mode": "ppo2"}, r"loss_mode"),
    ({"trainer.n_gpus_per_node": 16}, r"trainer\.n_gpus_per_node=16, but 8 device\(s\) were found per process"),
    ({"trainer.nnodes": 2}, r"trainer\.nnodes=2, but this run has 1 JAX process"),
]


@pytest.mark.parametrize("overrides,message", CASES)
def test_invalid_config_names_the_key(tmp_path, overrides, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        prepare(make_config(str(tmp_path), **overrides))


def test_cli_reports_invalid_config_without_traceback(tmp_path):
    proc = run_main(cli_args(str(tmp_path), **{"algorithm.adv_estimator": "grpoo",
                                                "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}), devices=1)
    assert proc.returncode == 2
    assert "algorithm.adv_estimator" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_main(cli_args(str(tmp_path), **{"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1})
                    + ["--config.actor_rollout_ref.actor.clip_ratio_hihg=0.3"], devices=1)
    assert proc.returncode == 2 and "clip_ratio_high" in proc.stderr and "Traceback" not in proc.stderr
