"""Score a generated file: ``python -m rlhf_jax.evaluate data.path=out.parquet [custom_reward_function.path=...]``.

verl's ``main_eval`` in keys (``evaluation.yaml``): ``data.path``, ``data.response_key`` (a list of
responses per row), ``data.data_source_key``, ``data.reward_model_key`` (a mapping holding
``ground_truth``), ``custom_reward_function.path`` / ``.name``; any ``reward_model.*`` rlhf_jax key
(``reward_model.answer_match``, ``reward_model.scorer_kwargs``) too. Responses are scored by the
trainer's reward manager. Prints one JSON object with, per data source and n responses per prompt:

- ``test_score/<source>``: verl's name for the mean over prompts of the mean response score;
- ``val-core/<source>/reward/mean@<n>`` (the same number) and ``.../best@<n>/mean`` (n > 1): what the
  trainer's validation logs for the same responses;
- ``pass@<k>/<source>`` for k = 1, 2, 4, ... <= n: the unbiased estimate of the chance that one of k
  responses passes (score >= ``pass_score``, default 1.0).
"""

from __future__ import annotations

import json
import math
import os
import sys

MAPPING: dict[str, str] = {}
OWN = {"data.path": None, "data.response_key": "responses", "data.data_source_key": "data_source",
       "data.reward_model_key": "reward_model", "data.prompt_key": "prompt", "pass_score": 1.0}
IGNORED = ("ray_kwargs.*", "data.use_shm")


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of n responses, c of which pass, include a passing one."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def metrics_of(by_source: dict[str, list[list[float]]], pass_score: float) -> dict[str, float]:
    """Per data source: ``scores[prompt][response]`` -> test_score, mean@n, best@n, pass@k."""
    out: dict[str, float] = {}
    for src, groups in sorted(by_source.items()):
        n = min(len(g) for g in groups)
        mean = sum(sum(g) / len(g) for g in groups) / len(groups)
        out[f"test_score/{src}"] = mean
        out[f"val-core/{src}/reward/mean@{n}"] = mean
        if n > 1:
            out[f"val-core/{src}/reward/best@{n}/mean"] = sum(max(g) for g in groups) / len(groups)
        k = 1
        while k <= n:
            out[f"pass@{k}/{src}"] = sum(pass_at_k(len(g), sum(s >= pass_score for s in g), k)
                                         for g in groups) / len(groups)
            k *= 2
    return out


def evaluate(cfg, own: dict) -> dict[str, float]:
    import numpy as np
    import pandas as pd

    from rlhf_jax.rewards import RewardManager

    path = own["data.path"]
    if not path or not os.path.isfile(os.path.expanduser(path)):
        raise ValueError(f"evaluate: data.path={path!r} is not a file (a parquet written by rlhf_jax.generate)")
    frame = pd.read_parquet(os.path.expanduser(path))
    for key in ("data.response_key", "data.data_source_key", "data.reward_model_key"):
        if own[key] not in frame.columns:
            raise ValueError(f"evaluate: {key}={own[key]!r} is not a column of {path} ({', '.join(frame.columns)})")
    manager = RewardManager.from_config(cfg.reward_model, cfg.custom_reward_function,
                                        max_response_length=cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length)
    try:
        by_source: dict[str, list[list[float]]] = {}
        for _, row in frame.iterrows():
            responses = [str(r) for r in row[own["data.response_key"]]]
            source = str(row[own["data.data_source_key"]])
            truth = row[own["data.reward_model_key"]]["ground_truth"]
            extra = row["extra_info"] if "extra_info" in frame.columns and isinstance(row["extra_info"], dict) else {}
            n = len(responses)
            result = manager.score([source] * n, responses, [truth] * n, [extra] * n)
            by_source.setdefault(source, []).append([float(s) for s in np.asarray(result.scores)])
    finally:
        manager.close()
    return metrics_of(by_source, float(own["pass_score"]))


def main(argv: list[str] | None = None) -> int:
    from rlhf_jax import verl_cli

    argv = list(sys.argv[1:] if argv is None else argv)
    from rlhf_jax import console

    console.configure()
    try:
        cfg, own = verl_cli.apply(verl_cli.parse_args(argv), MAPPING, IGNORED, OWN, "evaluate")
        metrics = evaluate(cfg, own)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
