"""Separate rollout devices (mesh.rollout_devices): sampling on 4 devices of its own, training on the other 4."""

import jax
import pytest

from rlhf_jax.train.setup import prepare
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, read_metrics

KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean",
        "training/rollout_probs_diff_mean")


def test_split_placement_trains_like_the_shared_layout(tmp_path):
    steps = {"trainer.total_training_steps": 3}
    shared = str(tmp_path / "shared")
    Trainer(make_config(shared, **steps)).fit()  # 8 devices: data 2 x fsdp 2 x tensor 2, sampling on all of them

    split = str(tmp_path / "split")
    trainer = Trainer(make_config(split, **steps, **{"mesh.rollout_devices": 4, "mesh.tensor": 1}))
    train_devices, rollout_devices = set(trainer.c.mesh.devices.flat), set(trainer.c.rollout_mesh.devices.flat)
    assert len(train_devices) == len(rollout_devices) == 4 and not train_devices & rollout_devices
    trainer.fit()
    # The sampler's weights live on the rollout devices only, and are the trained ones.
    sampling_params = trainer.rollouts.weights()
    for copy, trained in zip(jax.tree.leaves(sampling_params), jax.tree.leaves(trainer.actor.params)):
        assert set(copy.sharding.device_set) <= rollout_devices
        assert set(trained.sharding.device_set) <= train_devices
        assert (jax.device_get(copy) == jax.device_get(trained)).all()
    trainer.close()

    a, b = read_metrics(shared), read_metrics(split)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in KEYS:
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), (ra["step"], key)


@pytest.mark.parametrize("value,extra,message", [
    (8, {}, r"mesh\.rollout_devices=8 must be 0 \(shared devices\) or in \[1, 7\]"),
    (-1, {}, r"mesh\.rollout_devices=-1"),
    (3, {"mesh.tensor": 1, "mesh.fsdp": 1}, r"mesh\.rollout_devices=3 must divide data\.train_batch_size=4"),
])
def test_bad_rollout_device_counts_name_the_key(tmp_path, value, extra, message):
    with pytest.raises(ValueError, match=message):
        prepare(make_config(str(tmp_path), **{"mesh.rollout_devices": value, **extra}))
