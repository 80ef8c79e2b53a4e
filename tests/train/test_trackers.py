"""wandb (offline) and mlflow (local file store) receive the run's metrics; a missing package stops with the pip line."""

import os

import pytest

from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import cli_args, make_config, read_metrics, run_main
from tests.train.wandb_offline import offline_history

ONE_DEVICE = {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}


def test_wandb_and_mlflow_hold_the_metrics(tmp_path, monkeypatch):
    import mlflow  # both trackers come with the test extra
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    out = str(tmp_path / "run")
    Trainer(make_config(out, **{"trainer.logger": ("jsonl", "wandb", "mlflow"), "trainer.project_name": "proj",
                                "trainer.experiment_name": "exp"})).fit()
    expected = {r["step"]: r["critic/score/mean"] for r in read_metrics(out)}
    assert sorted(expected) == [1, 2]
    # wandb: the offline run directory next to the run's other logs, verl's metric names.
    history = offline_history(out)
    assert {r["_step"]: r["critic/score/mean"] for r in history} == pytest.approx(expected)
    # mlflow: a file store in the run directory, experiment = project, run name = experiment name.
    client = mlflow.tracking.MlflowClient(tracking_uri="file://" + os.path.join(out, "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "exp" and run.data.params["algorithm.adv_estimator"] == "grpo"
    scores = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "critic/score/mean")}
    assert scores == pytest.approx(expected)


@pytest.mark.parametrize("name,pip", [("wandb", "pip install wandb"), ("mlflow", "pip install mlflow")])
def test_missing_package_names_the_pip_command(tmp_path, name, pip):
    # The package made unimportable in the child (a None entry in sys.modules makes `import` fail).
    shim = tmp_path / "sitecustomize.py"
    shim.write_text(f"import sys\nsys.modules[{name!r}] = None\n")
    args = cli_args(str(tmp_path / "run"), **{"trainer.logger": ("console", name), **ONE_DEVICE})
    proc = run_main(args, devices=1, env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert pip in proc.stderr and "Traceback" not in proc.stderr
