"""verl's own ppo_trainer.yaml, in both shapes users have, trains 2 steps with only the tiny setup overridden.

The files (tests/config/verl/) are verl's: the flattened one its current release generates and the
legacy single file. Their ``trainer.logger: ['console', 'wandb']`` runs with WANDB_MODE=offline and
the offline run directory holds the metrics.
"""

import math
import os

import pytest

from tests.train.helpers import REPO, run_main
from tests.train.wandb_offline import offline_history

VERL = os.path.join(REPO, "tests", "config", "verl")
TINY = {  # model paths, data files, batch sizes and lengths for the tiny model, its devices, where the run goes
    "actor_rollout_ref.model.path": "builtin:tiny",
    "critic.model.path": "builtin:tiny",
    "data.train_files": "builtin:arithmetic?max_value=4&train_size=16",
    "data.val_files": "builtin:arithmetic?max_value=4&test_size=4",
    "data.train_batch_size": 4,
    "data.max_prompt_length": 32,
    "data.max_response_length": 4,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
    "critic.ppo_micro_batch_size_per_gpu": 1,
    "trainer.total_training_steps": 2,
    "trainer.n_gpus_per_node": 1,  # the files ask for 8 devices (on trainer.nnodes=1); this run has one
}


@pytest.mark.parametrize("name", ["_generated_ppo_trainer.yaml", "legacy_ppo_trainer.yaml"])
def test_verl_yaml_runs_two_steps_with_wandb_offline(tmp_path, name):
    out = str(tmp_path / "run")
    args = [f"--config={os.path.join(VERL, name)}", f"--config.trainer.default_local_dir={out}"]
    args += [f"--config.{k}={v}" for k, v in TINY.items()]
    proc = run_main(args, devices=1, env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # The keys with no JAX meaning are listed once, in one warning.
    assert proc.stderr.count("verl keys have no meaning in rlhf_jax and are ignored") == 1
    assert "actor_rollout_ref.actor.fsdp_config" in proc.stderr
    rows = offline_history(out)
    assert [r["_step"] for r in rows] == [0, 1, 2]  # val_before_train, then two steps
    assert "val-core/arithmetic/reward/mean@1" in rows[0]
    for r in rows[1:]:
        for key in ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/grad_norm"):
            assert math.isfinite(r[key]), key
    # verl's save_freq: -1 and test_freq: -1: nothing saved, no validation after training.
    assert not os.path.isdir(os.path.join(out, "checkpoints")) or not os.listdir(os.path.join(out, "checkpoints"))
    assert not any(k.startswith("val-core/") for k in rows[-1])
