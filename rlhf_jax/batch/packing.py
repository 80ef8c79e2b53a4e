"""Sequence packing: the real tokens of many (prompt, response) sequences in fixed-size rows, no padding between them.

A rollout batch holds left-padded prompts (N, P) and right-padded responses (N, R).
Most of those N x (P + R) cells are padding when responses have a long tail. Here
each sequence's valid tokens (its prompt tokens, then its response tokens) are
laid end to end in rows of ``row_len`` tokens with

- ``segment_ids``: 1, 2, ... per sequence within the row, 0 for the padding at
  the row's end (attention is confined to equal non-zero segments);
- ``positions``: restarting at 0 for each sequence (rotary positions as if alone);
- ``targets``: the grid cell that the token at the *next* position fills, i.e.
  ``r * R + t`` for the hidden state that predicts response token t of grid row
  r, and ``-1`` elsewhere. A training pass computes per-position log-probs (or
  values) and scatters them through ``targets`` into the ordinary (N, R) layout,
  where the loss code runs unchanged: losses and their denominators are exactly
  those of the unpacked batch.

Rows are grouped into micro-batches of at most ``max_rows_per_micro`` rows on
each data-parallel shard (a token budget of ``max_rows_per_micro x row_len``):
as few micro-batches as that allows, each with the same number of rows, rounded
up to a small set of sizes (1, 2, 3, 4, 6, 8, 12, ...: two per octave, see
``row_buckets``) so that a run compiles each pass for at most
2 log2(max_rows_per_micro) + 1 shapes while empty rows stay below a third. Each
shard packs only the sequences it holds (batch rows are split over shards in
contiguous blocks), so a micro-batch never needs another shard's data.

Log-prob passes need the vocabulary projection only where a response token is
predicted, not at prompt positions: ``logit_positions`` lists, per shard, the flat
positions (within the shard's ``rows x row_len`` block) whose ``targets`` are set,
padded with position 0 and target -1 to a size from the same two-per-octave set in
sixteenths of the micro-batch (``logit_list_size``), and ``logit_targets`` their grid
cells. (A list in whole rows wasted half the vocabulary projection of a two-row
micro-batch whose responses fill a bit more than one row's worth.)

Everything here is host NumPy; it runs once per mini-batch on a few integers per sequence.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlhf_jax.rollout.buckets import next_power_of_two

MIN_ROW_LEN = 64


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Packed micro-batches of one (mini-)batch; arrays are (n_micro, dp x rows_per_micro, row_len) int32."""

    input_ids: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    targets: np.ndarray  # flat index into the shard's block of the (rows, R) grid, -1 = none
    logit_positions: np.ndarray  # (n_micro, dp x logit_rows x row_len): positions whose target is set
    logit_targets: np.ndarray  # their grid cells (-1 on padding entries)
    real_tokens: int  # prompt + response tokens actually present
    padded_tokens: int  # cells computed: n_micro x dp x rows_per_micro x row_len

    @property
    def num_micro(self) -> int:
        return self.input_ids.shape[0]

    def micro(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids[i], "positions": self.positions[i], "segment_ids": self.segment_ids[i],
                "targets": self.targets[i], "logit_positions": self.logit_positions[i],
                "logit_targets": self.logit_targets[i]}


def row_length(max_seq_len: int, budget: int | None = None) -> int:
    """Row length for sequences of up to ``max_seq_len`` tokens: a power of two >= it (at least 64),
    capped at the token budget (which must itself hold the longest sequence)."""
    length = next_power_of_two(max(int(max_seq_len), MIN_ROW_LEN))
    return min(length, int(budget)) if budget else length


def row_buckets(max_rows: int) -> list[int]:
    """Allowed rows per micro-batch: 1, 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5x them) up to ``max_rows``,
    plus ``max_rows`` itself."""
    sizes, p = {int(max_rows)}, 1
    while p <= max_rows:
        sizes.update(x for x in (p, 3 * p // 2) if 1 <= x <= max_rows)
        p *= 2
    return sorted(sizes)


def micro_layout(rows_needed: int, max_rows: int) -> tuple[int, int]:
    """(micro-batches, rows per micro-batch) for ``rows_needed`` packed rows per shard."""
    n_micro = max(1, -(-rows_needed // max_rows))
    per_micro = -(-rows_needed // n_micro)
    return n_micro, next(b for b in row_buckets(max_rows) if b >= per_micro)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity, filled longest-first; each bin keeps
    its items in ascending index order (the order they appear in the row)."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-int(lengths[j]), j)):
        size = int(lengths[i])
        if size > capacity:
            raise ValueError(f"a sequence of {size} tokens does not fit a packed row of {capacity} tokens")
        for b, room in enumerate(free):
            if size <= room:
                bins[b].append(i)
                free[b] -= size
                break
        else:
            bins.append([i])
            free.append(capacity - size)
    return [sorted(b) for b in bins]


def deal_rows(rows: list[list[int]], lengths: np.ndarray, n_micro: int, cap: int) -> list[list[list[int]]]:
    """Deal rows to ``n_micro`` micro-batches of at most ``cap`` rows, fullest rows first, each to the
    micro-batch with the fewest tokens so far (balanced work per micro-batch)."""
    groups: list[list[list[int]]] = [[] for _ in range(n_micro)]
    load = np.zeros(n_micro)
    for row in sorted(rows, key=lambda r: -sum(int(lengths[i]) for i in r)):
        g = int(np.argmin(np.where([len(x) < cap for x in groups], load, np.inf)))
        groups[g].append(row)
        load[g] += sum(int(lengths[i]) for i in row)
    return groups


def pack_batch(
    prompts: np.ndarray,
    prompt_mask: np.ndarray,
    responses: np.ndarray,
    response_mask: np.ndarray,
    *,
    dp: int,
    row_len: int,
    max_rows_per_micro: int,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Pack a batch whose rows are split over ``dp`` shards in contiguous blocks.

    Responses must be contiguous from column 0 (the sampler's layout); prompts are left-padded.
    """
    N, R = responses.shape
    if N % dp:
        raise ValueError(f"{N} rows do not split over {dp} data-parallel shards")
    per_shard = N // dp
    p_len = prompt_mask.sum(1).astype(np.int64)
    r_len = response_mask.sum(1).astype(np.int64)
    lengths = p_len + r_len
    shard_rows = []
    for s in range(dp):
        idx = np.arange(s * per_shard, (s + 1) * per_shard)
        shard_rows.append([[int(idx[j]) for j in row] for row in first_fit_decreasing(lengths[idx], row_len)])
    n_micro, rows_per_micro = micro_layout(max(len(rows) for rows in shard_rows), max_rows_per_micro)

    shape = (n_micro, dp * rows_per_micro, row_len)
    ids = np.full(shape, pad_token_id, np.int32)
    pos = np.zeros(shape, np.int32)
    seg = np.zeros(shape, np.int32)
    tgt = np.full(shape, -1, np.int32)
    for s, rows in enumerate(shard_rows):
        for m, group in enumerate(deal_rows(rows, lengths, n_micro, rows_per_micro)):
            for k, row in enumerate(group):
                out_row = s * rows_per_micro + k
                col = 0
                for segment, i in enumerate(row, start=1):
                    p, r = int(p_len[i]), int(r_len[i])
                    prompt_ids = prompts[i][prompt_mask[i].astype(bool)]
                    ids[m, out_row, col:col + p] = prompt_ids
                    ids[m, out_row, col + p:col + p + r] = responses[i, :r]
                    pos[m, out_row, col:col + p + r] = np.arange(p + r)
                    seg[m, out_row, col:col + p + r] = segment
                    # The state at column col + p - 1 + t predicts response token t.
                    local_row = i - s * per_shard
                    tgt[m, out_row, col + p - 1:col + p - 1 + r] = local_row * R + np.arange(r)
                    col += p + r
    logit_pos, logit_tgt = compact_targets(tgt, dp, row_len, rows_per_micro)
    return PackedBatch(ids, pos, seg, tgt, logit_pos, logit_tgt, real_tokens=int(lengths.sum()),
                       padded_tokens=int(np.prod(shape)))


LOGIT_STEPS = 16  # the list's granularity: sixteenths of a micro-batch's cells


def logit_list_size(count: int, cells: int) -> int:
    """Entries of the compact logit list for ``count`` predicted positions among a shard's ``cells``: a size
    from ``row_buckets`` in sixteenths of the cells (1/16, 2/16, 3/16, 4/16, 6/16, ..., 16/16), so at most
    8 sizes per micro-batch shape, and beyond 2/16 at most a third of the list is padding."""
    unit = max(1, cells // LOGIT_STEPS)
    return unit * next(b for b in row_buckets(-(-cells // unit)) if b * unit >= count)


def compact_targets(tgt: np.ndarray, dp: int, row_len: int, rows_per_micro: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, targets) of the cells with a target, per shard, padded to a bucketed count (see module doc)."""
    n_micro = tgt.shape[0]
    blocks = tgt.reshape(n_micro, dp, rows_per_micro * row_len)
    size = logit_list_size(int((blocks >= 0).sum(-1).max(initial=1)), rows_per_micro * row_len)
    positions = np.zeros((n_micro, dp, size), np.int32)
    targets = np.full((n_micro, dp, size), -1, np.int32)
    for m in range(n_micro):
        for s in range(dp):
            where = np.nonzero(blocks[m, s] >= 0)[0]
            positions[m, s, :len(where)] = where
            targets[m, s, :len(where)] = blocks[m, s, where]
    return positions.reshape(n_micro, dp * size), targets.reshape(n_micro, dp * size)
