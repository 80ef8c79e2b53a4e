"""Generation validation, shared by the RL and SFT trainers: sample the validation prompts with
``rollout.val_kwargs`` (the same key every time), score them with the run's reward functions and report
verl's ``val-core/<data_source>/reward/mean@n`` (and ``best@n/mean``), combined over processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import numpy as np

from rlhf_jax.parallel.hosts import sum_over_processes, to_local
from rlhf_jax.runtime.loggers import dump_generations
from rlhf_jax.runtime.preemption import StopRequest
from rlhf_jax.train.trainer_rollout import Rollouts


@dataclasses.dataclass
class Validator:
    rollouts: Rollouts
    make_loader: Callable[[], Any]  # a fresh pass over the validation prompts (process-local batches)
    dataset: Any  # the validation PromptDataset (its data sources name the metrics)
    sampling: Any  # the validation SamplingParams
    stop: StopRequest
    logger: Any  # the run's MetricLogger (examples as text and in val_generations.jsonl)
    log_examples: int  # trainer.log_val_generations: examples to log
    dump_dir: str | None  # trainer.validation_data_dir: every generation as JSONL, or None
    is_main: bool

    def __call__(self, step: int) -> dict[str, float]:
        """The metrics after ``step`` steps; empty when a stop request arrives (partial scores would mislead)."""
        sampling = self.sampling
        by_source: dict[str, list[float]] = {}
        examples = []
        dump: dict[str, list] = {"inputs": [], "outputs": [], "gts": [], "scores": []}
        for pb in self.make_loader():
            if self.stop.agreed():
                return {}
            out, keep, text_mask = self.rollouts.sample(pb, sampling, self.rollouts.key(sampling.seed, 0), {})
            responses, rmask = to_local(out.responses)[:keep], to_local(text_mask)[:keep]
            scores, _, texts, _ = self.rollouts.score(pb, responses, rmask, sampling.n)
            dump["inputs"] += [t for t in pb.prompt_text for _ in range(sampling.n)]
            dump["gts"] += [g for g in pb.ground_truth for _ in range(sampling.n)]
            dump["outputs"] += texts
            dump["scores"] += [float(x) for x in scores]
            for i, s in enumerate(scores):
                src = pb.data_source[i // sampling.n]
                by_source.setdefault(src, []).append(float(s))
                if len(examples) < self.log_examples:
                    examples.append({"prompt": pb.prompt_text[i // sampling.n], "response": texts[i], "score": float(s),
                                     "ground_truth": str(pb.ground_truth[i // sampling.n])})
        if self.dump_dir:
            dump_generations(os.path.expanduser(self.dump_dir), step, **dump)
        metrics = self._combine(by_source)
        if examples and self.is_main:
            for ex in examples:
                self.logger.text(f"[val] {json.dumps(ex, ensure_ascii=False)}")
            self.logger.val_generations(step, examples)
        return metrics

    def _combine(self, by_source: dict[str, list[float]]) -> dict[str, float]:
        """Each process scored its own prompts: per-source sums and counts added over processes."""
        n = self.sampling.n
        sources = sorted({e.data_source for e in self.dataset.examples})
        totals = np.zeros((len(sources), 3))
        for j, src in enumerate(sources):
            groups = np.asarray(by_source.get(src, []), np.float64).reshape(-1, n)
            totals[j] = (groups.mean(1).sum(), groups.max(1).sum() if groups.size else 0.0, groups.shape[0])
        totals = sum_over_processes(totals)
        metrics = {}
        for j, src in enumerate(sources):
            mean_sum, best_sum, count = totals[j]
            if count == 0:
                continue
            metrics[f"val-core/{src}/reward/mean@{n}"] = float(mean_sum / count)
            if n > 1:
                metrics[f"val-core/{src}/reward/best@{n}/mean"] = float(best_sum / count)
        return metrics
