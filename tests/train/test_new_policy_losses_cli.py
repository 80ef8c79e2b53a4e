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


GDPO_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    fmt = float(solution_str.strip().isdigit())
    acc = float(solution_str.strip() == str(ground_truth).strip())
    return {"score": fmt + acc, "format_reward": fmt, "accuracy_reward": acc}
'''


def test_gdpo_one_step_with_the_reward_functions_components(tmp_path):
    reward = tmp_path / "components.py"
    reward.write_text(GDPO_REWARD)
    out = tmp_path / "run"
    proc = run_main([*ONE_STEP, "algorithm.adv_estimator=gdpo", f"reward.custom_reward_function.path={reward}",
                     "+algorithm.gdpo_reward_keys=['format_reward','accuracy_reward']",
                     "+algorithm.gdpo_reward_weights=[1.0,2.0]", f"trainer.default_local_dir={out}"], devices=1)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (row,) = read_metrics(str(out))
    assert math.isfinite(row["actor/pg_loss"])


def test_gdpo_without_its_reward_keys_is_refused_before_loading(tmp_path):
    proc = run_main([*ONE_STEP, "algorithm.adv_estimator=gdpo", f"trainer.default_local_dir={tmp_path / 'run'}"],
                    devices=1, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith("error: algorithm.adv_estimator=gdpo needs "
                                                   "algorithm.gdpo_reward_keys"), proc.stderr[-2000:]


def test_a_missing_component_is_named():
    import numpy as np
    import pytest as _pytest

    from rlhf_jax.rewards.manager import RewardFunctionError
    from rlhf_jax.train.trainer_rollout import reward_components

    got = reward_components({"a": np.array([1.0, 0.0]), "b": np.array([0.5, 0.5])}, ("b", "a"))
    np.testing.assert_array_equal(got, [[0.5, 1.0], [0.5, 0.0]])
    with _pytest.raises(RewardFunctionError, match="returned no 'c'"):  # main prints it in one line
        reward_components({"a": np.array([1.0])}, ("c",))
    with _pytest.raises(RewardFunctionError, match="returned no 'a' for 1 of 2 responses"):
        reward_components({"a": np.array([1.0, np.nan])}, ("a",))


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_skips_the_old_log_prob_pass(loss_type, tmp_path):
    # two mini-batches would recompute old log-probs; bypass mode uses the sampler's instead
    out = tmp_path / "run"
    proc = run_main([*ONE_STEP, "algorithm.rollout_correction.bypass_mode=True",
                     f"algorithm.rollout_correction.loss_type={loss_type}", "algorithm.rollout_correction.rollout_is=token",
                     "algorithm.rollout_correction.rollout_rs=token", "algorithm.rollout_correction.rollout_rs_threshold=5.0",
                     f"trainer.default_local_dir={out}"], devices=1)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (row,) = read_metrics(str(out))
    assert "timing_s/old_log_prob" not in row and "training/rollout_probs_diff_mean" not in row
    assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["rollout_corr/kl"])
    assert 0.0 <= row["rollout_corr/rollout_rs_masked_fraction"] <= 1.0


def test_bypass_mode_with_another_policy_loss_is_refused_by_name(tmp_path):
    proc = run_main([*ONE_STEP, "algorithm.rollout_correction.bypass_mode=True",
                     "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                     f"trainer.default_local_dir={tmp_path / 'run'}"], devices=1, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        "error: algorithm.rollout_correction.bypass_mode trains algorithm.rollout_correction.loss_type's loss, not "
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo: set loss_mode=vanilla")


def test_routing_replay_one_step_with_a_mixture_of_experts_actor(tmp_path):
    """R3 (verl's router_replay.mode): the sampler's expert choices replayed in the training passes, packed rows."""
    from tests.train.helpers import tiny_hf_checkpoint

    moe = tiny_hf_checkpoint("Qwen3MoeConfig", "Qwen3MoeForCausalLM", str(tmp_path / "moe"), num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=32)
    out = tmp_path / "run"
    proc = run_main([*ONE_STEP, f"actor_rollout_ref.model.path={moe}", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                     "+actor_rollout_ref.actor.router_replay.mode=R3", f"trainer.default_local_dir={out}"], devices=1)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (row,) = read_metrics(str(out))
    assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
    assert "timing_s/old_log_prob" in row  # two mini-batches: the old policy's pass ran, replaying the routes
