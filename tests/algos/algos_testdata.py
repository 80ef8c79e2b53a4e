"""Random test inputs for the algos tests: ragged masks, non-contiguous groups of uneven size."""

from __future__ import annotations

import numpy as np

# float32 implementation vs float64 reference.
RTOL = 1e-5
ATOL = 1e-5


def ragged_mask(rng: np.random.Generator, b: int, t: int, holes: bool = False) -> np.ndarray:
    """(b, t) float32 0/1 mask: random response lengths, row 0 all-masked, row 1 full; optional interior holes."""
    lengths = rng.integers(1, t + 1, size=b)
    lengths[0] = 0
    lengths[1] = t
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    if holes:
        mask = mask * (rng.random((b, t)) > 0.2)
    order = rng.permutation(b)  # the special rows land anywhere
    return mask[order].astype(np.float32)


def random_groups(rng: np.random.Generator, b: int) -> np.ndarray:
    """(b,) int32 group ids: sizes include 1, ids are large arbitrary ints, members are shuffled (non-contiguous)."""
    sizes = [1]
    while sum(sizes) < b:
        sizes.append(int(rng.integers(1, 5)))
    sizes[-1] -= sum(sizes) - b
    sizes = [s for s in sizes if s > 0]
    ids = rng.choice(np.arange(100, 100000), size=len(sizes), replace=False)
    g = np.concatenate([np.full(s, i) for s, i in zip(sizes, ids)])
    return rng.permutation(g).astype(np.int32)


def groups_of(ids: np.ndarray) -> dict[int, list[int]]:
    """Group id -> list of row indices (reference-side grouping, plain Python)."""
    out: dict[int, list[int]] = {}
    for i, g in enumerate(ids.tolist()):
        out.setdefault(g, []).append(i)
    return out


def agg_ref(L, M, mode, c=None):
    """float64 loops, straight from the table in ALGORITHMS.md (fully masked rows are not sequences)."""
    rows = [i for i in range(L.shape[0]) if M[i].sum() > 0]
    tok = lambda i: sum(L[i, t] * M[i, t] for t in range(L.shape[1]) if M[i, t] > 0)  # noqa: E731
    if mode == "token-mean":
        return sum(tok(i) for i in rows) / M.sum()
    if mode == "seq-mean-token-sum":
        return sum(tok(i) for i in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(tok(i) / M[i].sum() for i in rows) / len(rows)
    return sum(tok(i) for i in rows) / (L.shape[1] if c is None else c)
