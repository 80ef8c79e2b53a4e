"""Sampling training prompts by domain with given weights (ROLL's ``domain_interleave_probs``).

Every row has a domain: its ``data.domain_key`` column, else the domain whose ``data.domain_tags`` list holds its
``data.tag_key`` value, else ``data.default_domain`` (ROLL fills a missing ``domain`` column from its reward workers'
``tag_included`` lists, falling back to ``math_rule``). Each global batch of B prompts takes a fixed count from
each domain of ``data.domain_weights``, in the order listed: ``int(w * B)`` for every domain but the last, which
takes the rest (ROLL's per-domain batch sizes). Each domain draws from its own endless stream of its rows, epoch
after epoch; with ``data.shuffle`` epoch e is the previous epoch's order shuffled by ``random.Random(seed + e)``,
the order ROLL's per-domain scheduler walks. Rows of domains not listed are not used.

Batch k is a pure function of k (domain d's rows k*c .. (k+1)*c - 1 of its stream), so the loader's grain state
(the next batch number) resumes it exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlhf_jax.config.domain_weights import weights_problem
from rlhf_jax.data.sources import DataError, get_path

log = logging.getLogger(__name__)

def domain_counts(weights: Mapping[str, float], batch_size: int) -> dict[str, int]:
    """Prompts of each domain in a batch of ``batch_size``: int(w * B), the last domain the rest (as ROLL)."""
    names, out, taken = list(weights), {}, 0
    for i, name in enumerate(names):
        out[name] = batch_size - taken if i == len(names) - 1 else int(float(weights[name]) * batch_size)
        taken += out[name]
    return out


@dataclasses.dataclass(frozen=True)
class DomainSpec:
    """How a row's domain is found (data.domain_key, data.domain_tags, data.tag_key, data.default_domain)."""

    key: str = "domain"
    tags: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)  # domain -> tag values
    tag_key: str = "tag"
    default: str | None = None

    def domain_of(self, data: dict[str, Any], where: str) -> str:
        value = get_path(data, self.key, None)
        if value is not None:
            return _as_name(value, where, self.key, "data.domain_key")
        tag = get_path(data, self.tag_key, None) if self.tags else None
        if tag is not None:
            tag = _as_name(tag, where, self.tag_key, "data.tag_key")
            for domain, listed in self.tags.items():
                if tag in {str(t) for t in listed}:
                    return str(domain)
        if self.default is not None:
            return self.default
        tried = f"column {self.key!r} (data.domain_key)"
        if self.tags:
            tried += f" nor a {self.tag_key!r} value listed in data.domain_tags"
        raise DataError(f"{where}: no domain: the row has no {tried}; row has columns {sorted(data)} "
                        "(or set data.default_domain)")


def _as_name(value: Any, where: str, column: str, key: str) -> str:
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"{where}: column {column!r} ({key}) must be a string, got {type(value).__name__}")


class DomainPlan:
    """Which dataset rows make up each global batch when sampling by domain."""

    def __init__(self, domains: Sequence[str | None], weights: Mapping[str, float], batch_size: int, *,
                 seed: int, shuffle: bool):
        problem = weights_problem(weights)
        if problem or not weights:
            raise DataError(problem or "data.domain_weights is empty")
        self.names = [str(d) for d in weights]
        self.counts = domain_counts(weights, batch_size)
        found = sorted({d for d in domains if d is not None})
        rows = {d: np.array([i for i, dom in enumerate(domains) if dom == d], np.int64) for d in self.names}
        for d in self.names:
            if not len(rows[d]):
                raise DataError(f"data.domain_weights: domain {d!r} has no rows in data.train_files "
                                f"(domains found: {found})")
            if self.counts[d] > len(rows[d]):
                raise DataError(f"data.domain_weights: domain {d!r} takes {self.counts[d]} prompts of each batch of "
                                f"{batch_size} (data.train_batch_size) but has {len(rows[d])} rows")
        unused = len([d for d in domains if d not in rows])
        if unused:
            log.info("sampling by domain leaves out %d rows of domains not in data.domain_weights", unused)
        self.rows = rows
        self.num_rows = sum(len(r) for r in rows.values())
        self.seed, self.shuffle = int(seed), bool(shuffle)
        # dataset row -> the domain's position in data.domain_weights (the per-domain statistics' segment)
        self.domain_ids = np.full(len(domains), -1, np.int32)
        for j, d in enumerate(self.names):
            self.domain_ids[rows[d]] = j
        self._orders: dict[str, tuple[int, list[int]]] = {}  # domain -> (epoch, that epoch's order)

    def describe(self) -> str:
        """Each batch's share of every domain, and the rows it draws from."""
        batch = sum(self.counts.values())
        return f"each batch of {batch}: " + ", ".join(f"{d} {self.counts[d]} (of {len(self.rows[d])} rows)"
                                                       for d in self.names)

    def _order(self, d: str, epoch: int) -> list[int]:
        """Positions in domain d's rows for one epoch: each epoch re-shuffles the previous one in place (as
        ROLL's scheduler does), so epoch e follows from epoch 0 by e further shuffles."""
        n = len(self.rows[d])
        if not self.shuffle:
            return list(range(n))
        at, order = self._orders.get(d, (-1, []))
        if at > epoch:
            at, order = -1, []
        if at < 0:
            order = list(range(n))
        for e in range(at + 1, epoch + 1):
            random.Random(self.seed + e).shuffle(order)
        self._orders[d] = (epoch, order)
        return order

    def batch(self, step: int) -> np.ndarray:
        """The global batch ``step``'s dataset rows: each domain's share in data.domain_weights' order."""
        parts = []
        for d in self.names:
            c, n = self.counts[d], len(self.rows[d])
            picks = []
            for j in range(step * c, (step + 1) * c):
                picks.append(self._order(d, j // n)[j % n])
            parts.append(self.rows[d][np.asarray(picks, np.int64)] if picks else np.zeros(0, np.int64))
        return np.concatenate(parts)
