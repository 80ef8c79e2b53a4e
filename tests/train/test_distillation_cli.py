"""On-policy distillation through the command line in verl's keys: the teacher (another checkpoint) scores the
student's samples in the reference's pass, and the divergence trains the student, as a reward or as a loss."""

from __future__ import annotations

import math

import pytest

from tests.train.helpers import read_metrics, run_main, tiny_hf_checkpoint
from tests.train.test_new_policy_losses_cli import ONE_STEP


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny Llama over the student's vocabulary, with other weights (wider MLP, another init)."""
    return tiny_hf_checkpoint("LlamaConfig", "LlamaForCausalLM", str(tmp_path_factory.mktemp("teacher")),
                              intermediate_size=128, initializer_range=0.2)


LOSSES = {"reward_k1": ["distillation.distillation_loss.loss_mode=k1",
                        "+distillation.distillation_loss.use_policy_gradient=True",
                        "distillation.distillation_loss.use_task_rewards=False", "actor_rollout_ref.rollout.n=1"],
          "loss_k3": ["distillation.distillation_loss.loss_mode=k3",
                      "distillation.distillation_loss.distillation_loss_coef=0.5"],
          "loss_topk": ["distillation.distillation_loss.loss_mode=forward_kl_topk",
                        "distillation.distillation_loss.topk=8", "distillation.distillation_loss.log_prob_min_clamp=-10"]}


@pytest.mark.parametrize("mode", sorted(LOSSES))
def test_the_student_learns_from_the_teachers_log_probs(mode, teacher, tmp_path):
    out = tmp_path / "run"
    loss = LOSSES[mode]
    proc = run_main([*ONE_STEP, "distillation.enabled=True", f"distillation.teacher_models.teacher_model.model_path={teacher}",
                     "distillation.n_gpus_per_node=4", "distillation.teacher_models.teacher_model.inference.name=vllm",
                     *loss, f"trainer.default_local_dir={out}"], devices=1)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (row,) = read_metrics(str(out))
    # another model: a real divergence (forward_kl_topk's is never negative, its loss is its size)
    assert row["distillation/loss" if mode == "loss_topk" else "distillation/abs_loss"] > 0.05
    assert math.isfinite(row["distillation/loss"]) and row["actor/grad_norm"] > 0
    assert "timing_s/ref" in row  # the teacher's pass, in the reference's place
    if mode == "reward_k1":
        assert "distillation/pg_clipfrac" in row
    if mode == "loss_topk":  # the teacher's 8 most probable tokens hold most, not all, of either model's mass
        assert 0 < row["distillation/teacher_mass"] < 1 and 0 < row["distillation/student_mass"] < 1


@pytest.mark.parametrize("extra, message", [
    (["distillation.distillation_loss.loss_mode=k1"], "distillation.distillation_loss.loss_mode=k1 as a loss"),
    (["distillation.distillation_loss.loss_mode=reverse_kl_topk"], "loss_mode='reverse_kl_topk' is not valid"),
    (["distillation.distillation_loss.topk=0"], "distillation.distillation_loss.topk"),
    (["actor_rollout_ref.actor.use_kl_loss=True"], "actor_rollout_ref.actor.use_kl_loss=True with distillation"),
])
def test_what_cannot_run_is_refused_in_one_line_before_loading(extra, message, teacher, tmp_path):
    proc = run_main([*ONE_STEP, "distillation.enabled=True", f"distillation.teacher_models.teacher_model.model_path={teacher}",
                     *extra, f"trainer.default_local_dir={tmp_path / 'run'}"], devices=1, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
