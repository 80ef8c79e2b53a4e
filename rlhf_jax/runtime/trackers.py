"""Experiment trackers users already have: wandb and mlflow, chosen in ``trainer.logger`` as in verl.

Both are optional dependencies (``pip install wandb`` / ``pip install mlflow``);
config validation checks that they import, so a missing package stops the run
before anything is built, with the pip command in the message.

- ``wandb``: ``wandb.init(project=trainer.project_name, name=trainer.experiment_name,
  config=<the whole config>)`` as verl does; ``WANDB_MODE=offline`` writes a local run
  directory (under ``trainer.log_dir/wandb`` unless ``WANDB_DIR`` says otherwise).
- ``mlflow``: ``MLFLOW_TRACKING_URI`` if set, else a file store in ``trainer.log_dir/mlruns``;
  the experiment is the project, the run is named after the experiment (``MLFLOW_RUN_ID``
  continues a given run); the config is logged as parameters, metric names are
  sanitized as verl does (``@`` -> ``_at_``).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


def _flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


class WandbTracker:
    def __init__(self, log_dir: str, project: str, experiment: str, config: dict):
        import wandb

        os.makedirs(log_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=experiment, entity=os.environ.get("WANDB_ENTITY"), config=config,
                              dir=os.environ.get("WANDB_DIR", log_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    _INVALID = re.compile(r"[^/\w.\- :]")  # what MLflow allows in a metric name

    def __init__(self, log_dir: str, project: str, experiment: str, config: dict):
        import mlflow

        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a local store next to the run's other logs, needing no database packages
            uri = "file://" + os.path.join(os.path.abspath(log_dir), "mlruns")
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 asks before using a file store
        mlflow.set_tracking_uri(uri)
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if run_id:
            mlflow.start_run(run_id=run_id)
        else:
            exp = mlflow.set_experiment(project)
            mlflow.start_run(experiment_id=exp.experiment_id, run_name=experiment)
        mlflow.log_params(_flatten(config))

    def _name(self, key: str) -> str:
        return self._INVALID.sub("_", re.sub(r"/+", "/", key.replace("@", "_at_")))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.mlflow.log_metrics({self._name(k): v for k, v in _numbers(metrics).items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}
