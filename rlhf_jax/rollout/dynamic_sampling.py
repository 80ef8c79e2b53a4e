"""DAPO's dynamic sampling (``algorithm.filter_groups``): keep only prompt groups whose metric varies.

A group whose n responses all score the same has zero advantage under group-relative estimators and
teaches nothing; DAPO drops such groups and samples further prompt batches until ``train_batch_size``
groups remain (at most ``max_num_gen_batches`` batches when > 0), then trains on the first of them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlhf_jax.types import ROLLOUT_ARRAYS, ROLLOUT_OPTIONAL

# RolloutBatch's arrays; of those some rollouts carry: multi-turn's trained-token mask, partial rollouts' versions,
# and R3's expert ids (rows, P + R, layers, k), the prompt's columns then the response's
ROLLOUT_KEYS, OPTIONAL_KEYS = ROLLOUT_ARRAYS, ROLLOUT_OPTIONAL
_PROMPT_AXIS = ("prompts", "prompt_mask")
_RESPONSE_AXIS = ("responses", "response_mask", "logprobs", "response_valid", "versions")
_BOTH_AXES = ("routed_experts",)


def varied_groups(values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the prompt groups (``n`` consecutive rows each) whose values are not all equal; token-level
    values (rows, R) are summed over each row first (per-turn rewards: the row's return).

    A group of one response is always kept (verl's rule: its variance says nothing).
    """
    values = np.asarray(values, np.float64)
    groups = (values.sum(axis=1) if values.ndim == 2 else values).reshape(-1, n)
    if n == 1:
        return np.arange(groups.shape[0])
    return np.nonzero(groups.std(axis=1) > 0)[0]


@dataclasses.dataclass
class Collected:
    """The kept groups of the batches sampled so far (global numpy rows, prompt-major)."""

    n: int
    pad_token_id: int
    parts: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)

    @property
    def num_groups(self) -> int:
        return sum(p["scores"].shape[0] for p in self.parts) // self.n

    def add(self, rollout: dict[str, np.ndarray], scores: np.ndarray, keep: np.ndarray,
            domain: np.ndarray | None = None, **per_row: np.ndarray | None) -> None:
        """``rollout``: the ROLLOUT_KEYS arrays and any OPTIONAL_KEYS ones; ``scores`` (rows,) or token-level
        (rows, R); ``domain`` (rows,): each row's data domain, kept with its group (the per-domain statistics'
        segments); ``per_row``: further values of each row kept with its group (None: none), e.g. GDPO's
        ``components`` (rows, K), ReMax's ``baselines`` (rows,)."""
        rows = (keep[:, None] * self.n + np.arange(self.n)[None, :]).reshape(-1)
        part = {**{k: rollout[k][rows] for k in (*ROLLOUT_KEYS, *OPTIONAL_KEYS) if k in rollout},
                "scores": scores[rows]}
        per_row = {"domain": domain, **per_row}
        part.update({name: np.asarray(values)[rows] for name, values in per_row.items() if values is not None})
        self.parts.append(part)

    def batch(self, num_groups: int) -> dict[str, np.ndarray]:
        """The first ``num_groups`` groups; prompts left-padded and responses right-padded to common widths (a
        padded token is masked out, drawn by no version and routed by no expert: -1)."""
        P = max(p["prompts"].shape[1] for p in self.parts)
        R = max(p["responses"].shape[1] for p in self.parts)
        fills = {"prompts": self.pad_token_id, "responses": self.pad_token_id, "versions": -1, "routed_experts": -1}
        out = {}
        for key in self.parts[0]:
            arrays = []
            for p in self.parts:
                x, fill = p[key], fills.get(key, 0)
                if key in _PROMPT_AXIS:
                    x = _pad_axis1(x, P - x.shape[1], 0, fill)
                elif key in _RESPONSE_AXIS or (key == "scores" and x.ndim == 2):
                    x = _pad_axis1(x, 0, R - x.shape[1], fill)
                elif key in _BOTH_AXES:  # the prompt's columns, then the response's
                    width = p["prompts"].shape[1]
                    x = np.concatenate([_pad_axis1(x[:, :width], P - width, 0, fill),
                                        _pad_axis1(x[:, width:], 0, R - p["responses"].shape[1], fill)], axis=1)
                arrays.append(x)
            out[key] = np.concatenate(arrays)[:num_groups * self.n]
        return out


def _pad_axis1(x: np.ndarray, before: int, after: int, fill) -> np.ndarray:
    """``x`` with ``before`` and ``after`` columns of ``fill`` around its axis 1 (unchanged when both are 0)."""
    if not before and not after:
        return x
    return np.pad(x, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
