"""``python -m rlhf_jax.plot``: a metrics file becomes one PNG of the documented size; bad input is one line."""

import json
import struct

import numpy as np

from rlhf_jax.plot import DPI, FIGSIZE_IN, panel_lines, read_metrics, series
from tests.train.helpers import run_tool


def _png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def _write_metrics(path, steps: int = 12) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for step in range(0, steps + 1):
            record = {"step": step}
            if step % 4 == 0:
                record["val-core/gsm8k/reward/mean@1"] = float(rng.uniform())
            if step > 0:
                record.update({"critic/score/mean": float(rng.uniform()), "response_length/mean": float(rng.uniform(20, 90)),
                               "actor/entropy": float(rng.uniform(0.5, 2.0)), "timing_s/step": 1.0})
            f.write(json.dumps(record) + "\n")
        # a resumed run re-logs step 12: the last record wins
        f.write(json.dumps({"step": 12, "critic/score/mean": 0.5, "actor/entropy": 1.0}) + "\n")


def test_the_plot_command_writes_a_png_of_the_expected_size(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl")
    out = tmp_path / "figs" / "curve.png"
    proc = run_tool("rlhf_jax.plot", str(tmp_path), "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert _png_size(str(out)) == (int(FIGSIZE_IN[0] * DPI), int(FIGSIZE_IN[1] * DPI))
    # default output: next to the metrics
    proc = run_tool("rlhf_jax.plot", str(tmp_path), timeout=300)
    assert proc.returncode == 0 and (tmp_path / "curve.png").stat().st_size > 10_000


def test_the_plotted_series_are_the_logged_values(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl")
    by_step = read_metrics(str(tmp_path / "metrics.jsonl"))
    val = series(by_step, ("val-core/",))
    assert list(val) == ["val-core/gsm8k/reward/mean@1"] and val["val-core/gsm8k/reward/mean@1"][0] == [0, 4, 8]  # step 12 re-logged without it
    steps, reward = series(by_step, ("critic/score/mean",))["critic/score/mean"]
    assert steps == list(range(1, 13)) and reward[-1] == 0.5  # the re-logged step replaced the first record
    assert "timing_s/step" not in series(by_step, ("critic/score/mean", "val-core/"))


def test_a_directory_without_metrics_is_one_line(tmp_path):
    proc = run_tool("rlhf_jax.plot", str(tmp_path), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error:") and "metrics.jsonl" in proc.stderr
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    proc = run_tool("rlhf_jax.plot", str(tmp_path), timeout=300)
    assert proc.returncode == 2 and "line 2" in proc.stderr


def _write_run(path, seed: int, steps: int = 8) -> None:
    rng = np.random.default_rng(seed)
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(0, steps + 1):
            record = {"step": step}
            if step % 4 == 0:
                record["val-core/gsm8k/reward/mean@1"] = float(rng.uniform())
            if step > 0 and step != 3 + seed:  # each run misses a different step of the training reward
                record["critic/score/mean"] = float(rng.uniform())
            f.write(json.dumps(record) + "\n")


def test_several_runs_draw_one_line_each_and_their_mean(tmp_path):
    runs = [tmp_path / f"seed{seed}" for seed in range(3)]
    for seed, run in enumerate(runs):
        _write_run(run, seed)
    loaded = [(run.name, read_metrics(str(run / "metrics.jsonl"))) for run in runs]
    val = panel_lines(loaded, ("val-core/",))
    assert [line.label for line in val] == ["seed0", "seed1", "seed2", "mean of 3"]
    assert [line.is_mean for line in val] == [False, False, False, True]
    expected = np.mean([line.values for line in val[:3]], axis=0)  # every run has steps 0, 4, 8
    assert val[3].steps == [0, 4, 8] and np.allclose(val[3].values, expected, rtol=1e-12)
    reward = panel_lines(loaded, ("critic/score/mean",))
    mean = reward[-1]
    assert mean.is_mean and mean.steps == [1, 2, 6, 7, 8]  # steps 3, 4 and 5 are each missing from one run
    for i, step in enumerate(mean.steps):
        values = [dict(zip(line.steps, line.values))[step] for line in reward[:3]]
        assert abs(mean.values[i] - sum(values) / 3) < 1e-12
    # the command: several directories, one picture in their common parent
    proc = run_tool("rlhf_jax.plot", *map(str, runs), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "curves.png")
    assert _png_size(str(tmp_path / "curves.png")) == (int(FIGSIZE_IN[0] * DPI), int(FIGSIZE_IN[1] * DPI))
    # one run among them without metrics: one line naming it
    (tmp_path / "empty").mkdir()
    proc = run_tool("rlhf_jax.plot", str(runs[0]), str(tmp_path / "empty"), timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "empty" in proc.stderr
