"""A run's logs live in its own directory: no appending to another run's files, no step logged twice on resume."""

import json
import os

from rlhf_jax.runtime.loggers import own_file
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, read_metrics


def _steps(out: str) -> list[int]:
    return [r["step"] for r in read_metrics(out)]


def test_same_experiment_name_different_directories_keep_their_own_logs(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    Trainer(make_config(a, **{"trainer.total_training_steps": 2, "trainer.logger": ("jsonl", "tensorboard")})).fit()
    Trainer(make_config(b, **{"trainer.total_training_steps": 1, "trainer.logger": ("jsonl", "tensorboard")})).fit()
    assert _steps(a) == [1, 2] and _steps(b) == [1]
    for out in (a, b):
        assert os.listdir(os.path.join(out, "tensorboard"))  # event files next to the checkpoints
        assert os.path.isdir(os.path.join(out, "checkpoints"))


def test_fresh_run_moves_an_earlier_runs_files_aside(tmp_path):
    out = str(tmp_path / "run")
    overrides = {"trainer.total_training_steps": 2, "trainer.logger": ("jsonl", "tensorboard"),
                 "trainer.test_freq": 2, "trainer.log_val_generations": 1}
    Trainer(make_config(out, **overrides)).fit()
    first = read_metrics(out)
    # Same directory, no resume: a new run, whose files must not mix with the first one's.
    Trainer(make_config(out, **{**overrides, "trainer.resume_mode": "disable", "trainer.total_training_steps": 1,
                                "trainer.test_freq": 1})).fit()
    assert _steps(out) == [1]
    with open(os.path.join(out, "metrics.jsonl.1")) as f:
        assert [json.loads(line) for line in f] == first
    with open(os.path.join(out, "val_generations.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1]
    with open(os.path.join(out, "val_generations.jsonl.1")) as f:
        assert [json.loads(line)["step"] for line in f] == [2]
    assert os.listdir(os.path.join(out, "tensorboard.1")) and os.listdir(os.path.join(out, "tensorboard"))


def test_resumed_run_logs_each_step_once(tmp_path):
    out = str(tmp_path / "run")
    Trainer(make_config(out, **{"trainer.total_training_steps": 2, "trainer.save_freq": 2})).fit()
    # As if the run had logged step 3 and crashed before its checkpoint: the resumed run does step 3 again.
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 3, "stale": True}) + "\n" + '{"step": 4, "cut sh')
    Trainer(make_config(out, **{"trainer.total_training_steps": 4, "trainer.save_freq": 2})).fit()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert not any("stale" in r for r in rows)


def test_own_file_keeps_records_up_to_the_resumed_step(tmp_path):
    path = str(tmp_path / "m.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 1, 2, 3, 2)))
    own_file(path, 2)
    with open(path) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2, 2]
    own_file(path, 0)
    assert not os.path.exists(path) and os.path.exists(path + ".1")
    open(path, "w").close()
    own_file(path, 0)
    assert os.path.exists(path + ".2")  # the first free number
