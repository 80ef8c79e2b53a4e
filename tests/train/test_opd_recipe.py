"""The on-policy distillation recipe (configs/opd.py): a fresh student learns the SFT recipe's arithmetic from the
teacher's log-probs alone, its greedy validation accuracy rising from 0."""

from __future__ import annotations

import os

from tests.train.helpers import read_metrics, run_main


def test_the_student_learns_from_the_teacher_alone(tmp_path):
    teacher_run = tmp_path / "sft"
    proc = run_main(["--config=configs/sft.py", f"--config.trainer.default_local_dir={teacher_run}",
                     f"--config.trainer.log_dir={teacher_run}"], devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    teacher = os.path.join(teacher_run, "hf", "global_step_100")
    student = tmp_path / "opd"
    proc = run_main(["--config=configs/opd.py", f"--config.distillation.teacher_models.teacher_model.model_path={teacher}",
                     "--config.trainer.total_training_steps=200", "--config.trainer.test_freq=200",
                     f"--config.trainer.default_local_dir={student}", f"--config.trainer.log_dir={student}"], devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = [r["val-core/arithmetic/reward/mean@1"] for r in read_metrics(str(student))
                if "val-core/arithmetic/reward/mean@1" in r]
    assert accuracy[0] < 0.05 and accuracy[-1] > accuracy[0] + 0.15, accuracy  # 0.0 -> 0.32 on the dev machine
    rows = [r for r in read_metrics(str(student)) if "distillation/loss" in r]
    assert len(rows) == 200 and all("actor/pg_loss" in r for r in rows)
