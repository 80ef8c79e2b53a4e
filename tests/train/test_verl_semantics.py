"""Keys mean what they mean in verl: save_freq / test_freq <= 0 is "never", None (the default) "at the end"."""

import os

from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, read_metrics


def _has_val(row: dict) -> bool:
    return any(k.startswith("val-core/") for k in row)


def test_minus_one_saves_nothing_and_never_validates(tmp_path):
    out = str(tmp_path / "run")
    Trainer(make_config(out, **{"trainer.save_freq": -1, "trainer.test_freq": -1,
                                "trainer.save_hf_checkpoint": "last"})).fit()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and not any(_has_val(r) for r in rows)
    assert not os.path.exists(os.path.join(out, "checkpoints")) or not os.listdir(os.path.join(out, "checkpoints"))
    assert not os.path.exists(os.path.join(out, "hf"))


def test_defaults_save_and_validate_at_the_last_step_only(tmp_path):
    out = str(tmp_path / "run")
    cfg = make_config(out, **{"trainer.total_training_steps": 3, "trainer.val_before_train": True})
    cfg.trainer.save_freq, cfg.trainer.test_freq = None, None  # the schema defaults (the recipe sets numbers)
    Trainer(cfg).fit()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [_has_val(r) for r in rows] == [True, False, False, True]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["3"]


def test_every_n_steps_and_at_the_last(tmp_path):
    out = str(tmp_path / "run")
    Trainer(make_config(out, **{"trainer.total_training_steps": 3, "trainer.save_freq": 2,
                                "trainer.test_freq": 2})).fit()
    rows = read_metrics(out)
    assert [_has_val(r) for r in rows] == [False, True, True]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2", "3"]


def test_remax_runs_with_its_greedy_baseline(tmp_path):
    import math

    out = str(tmp_path / "run")
    trainer = Trainer(make_config(out, **{"algorithm.adv_estimator": "remax", "trainer.total_training_steps": 3}))
    trainer.fit()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["timing_s/gen_max"] > 0  # the greedy rollout ran
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/mean"))
    # Advantages are reward-to-go minus the greedy score: with the dense reward they are not all zero.
    assert any(r["critic/advantages/max"] != r["critic/advantages/min"] for r in rows)


def test_full_kl_is_rejected_before_anything_is_built(tmp_path):
    import pytest

    from rlhf_jax.train.setup import prepare

    for overrides, key in (({"actor_rollout_ref.actor.use_kl_loss": True,
                             "actor_rollout_ref.actor.kl_loss_type": "full"}, "actor_rollout_ref.actor.kl_loss_type"),
                           ({"algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": "full"},
                            "algorithm.kl_penalty")):
        with pytest.raises(ValueError, match=f"{key}=full .*not supported.*low_var_kl"):
            prepare(make_config(str(tmp_path), **overrides))
    # Unused, it changes nothing and is accepted (verl's files carry a kl_loss_type whether or not the loss is on).
    prepare(make_config(str(tmp_path), **{"actor_rollout_ref.actor.use_kl_loss": False,
                                          "actor_rollout_ref.actor.kl_loss_type": "full"}))
