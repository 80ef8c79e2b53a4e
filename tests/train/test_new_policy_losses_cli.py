"""Policy losses and advantage estimators added from verl's newer releases, each one trainer step through the command
line (verl's syntax)."""

from __future__ import annotations

import math

import pytest

from tests.train.helpers import read_metrics, run_main

ONE_STEP = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.model.path=builtin:tiny",
            "data.train_files=['builtin:arithmetic?max_value=4&train_size=16']",
            "data.val_files=['builtin:arithmetic?max_value=4&test_size=4']",
            "data.prompt_template=raw", "data.train_batch_size=4", "data.max_prompt_length=16",
            "data.max_response_length=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "trainer.logger=['jsonl']",
            "trainer.n_gpus_per_node=1", "trainer.total_training_steps=1", "trainer.save_hf_checkpoint=never",
            "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1"]


@pytest.mark.parametrize("mode, extra", [("geo_mean", []), ("sapo", ["actor_rollout_ref.actor.tau_neg=1.2"]),
                                        ("dro", ["+actor_rollout_ref.actor.policy_loss.dro_beta=0.1"]),
                                        ("dppo_tv", []), ("dppo_kl", [])])
def test_one_step_through_the_command_line(mode, extra, tmp_path):
    out = tmp_path / "run"
    proc = run_main([*ONE_STEP, f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", *extra,
                     f"trainer.default_local_dir={out}"], devices=1)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (row,) = read_metrics(str(out))
    assert math.isfinite(row["actor/pg_loss"]) and row["actor/pg_clipfrac"] >= 0


@pytest.mark.parametrize("estimator", ["grpo_vectorized", "rloo_vectorized"])
def test_estimator_one_step_through_the_command_line(estimator, tmp_path):
    out = tmp_path / "run"
    proc = run_main([*ONE_STEP, f"algorithm.adv_estimator={estimator}", f"trainer.default_local_dir={out}"],
                    devices=1)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (row,) = read_metrics(str(out))
    assert math.isfinite(row["actor/pg_loss"])


def test_dro_without_its_weight_is_refused_before_loading(tmp_path):
    proc = run_main([*ONE_STEP, "actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                     f"trainer.default_local_dir={tmp_path / 'run'}"], devices=1, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == ("error: actor_rollout_ref.actor.policy_loss.loss_mode=dro needs "
                                            "actor_rollout_ref.actor.policy_loss.dro_beta > 0, got None")
