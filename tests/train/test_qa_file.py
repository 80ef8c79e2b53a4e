"""A Question/Answer JSON file as users bring it trains with no keys beyond the file names."""

import json
import math
import os
import random

from tests.train.helpers import REPO, read_metrics, run_main


def test_question_answer_json_runs_with_only_the_file_names(tmp_path):
    rng = random.Random()
    def row():
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        return {"Question": f"{a}+{b}=", "Answer": str(a + b)}
    qa = tmp_path / "qa.json"
    qa.write_text(json.dumps({"train": [row() for _ in range(40)], "test": [row() for _ in range(6)]}))
    out = str(tmp_path / "run")
    # The default recipe, two steps, this run's directory, and nothing else but the data files.
    proc = run_main([f"--config={os.path.join(REPO, 'configs', 'grpo.py')}", f"--config.data.train_files={qa}",
                     f"--config.data.val_files={qa}", "--config.trainer.total_training_steps=2",
                     f"--config.trainer.default_local_dir={out}"], devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "data_source qa: no built-in scorer, scored by answer_match" in proc.stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]  # validation before training, then two steps
    assert "val-core/qa/reward/mean@1" in rows[0] and "val-core/qa/reward/mean@1" in rows[-1]
    assert all(math.isfinite(r["critic/score/mean"]) for r in rows[1:])
    assert os.path.isdir(os.path.join(out, "checkpoints", "2"))
