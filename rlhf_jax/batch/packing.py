"""Sequence packing: the real tokens of many (prompt, response) sequences in fixed-size rows, no padding between them.

A rollout batch holds left-padded prompts (N, P) and right-padded responses (N, R).
Most of those N x (P + R) cells are padding when responses have a long tail. Here
the valid tokens are laid end to end in rows of ``row_len`` tokens, and the samples
of one prompt (GRPO's group, every sample of ``rollout.n > 1``) share a single copy
of it: a *unit* is one prompt followed by the responses drawn from it (as many as fit
a row; a group too long for one row becomes several units, each with the prompt).
On the GRPO benchmark shape (8 samples of ~40-token prompts, ~35-token responses)
that removes about half of the tokens the training passes would otherwise compute.
The outputs are exactly those of separate sequences: a prompt token's state does not
depend on what follows it, and each response sees only its prompt and itself.

- ``segment_ids``: unit u of a row has ``u << BRANCH_BITS`` on its prompt and
  ``(u << BRANCH_BITS) | k`` on its k-th response, 0 on the row's padding. A query sees
  a key with the same id or its unit's prompt id (``models.blockwise.visible``); ids
  below ``1 << BRANCH_BITS`` (one plain sequence each) see only their own segment.
- ``positions``: restarting at 0 for each unit's prompt, a response continuing from its
  prompt's length (rotary positions as if each sequence were alone).
- ``logit_positions`` / ``logit_targets``: per shard, the flat positions (within the
  shard's ``rows x row_len`` block) of the states that predict a response token, and
  the grid cell ``r * R + t`` of the token each predicts (response token 0 of every
  response of a unit is predicted by the same state, the prompt's last, so a position
  may appear several times). Padded with position 0 and target -1 to a size from the
  same two-per-octave set in sixteenths of the micro-batch (``logit_list_size``).
  Only these states go through the vocabulary projection; a training pass scatters
  its per-entry log-probs (or values) through the targets into the ordinary (N, R)
  layout, where the loss code runs unchanged: losses and their denominators are
  exactly those of the unpacked batch.
- ``route_sources``: the shard-local cell ``r * (P + R) + column`` of the batch's
  (N, P + R) sequence grid each packed position holds (-1 on padding; a shared
  prompt's positions name its unit's first sequence), so per-token model inputs on
  that grid (a MoE's recorded expert ids) can be gathered into the packed rows and
  per-position outputs scattered back; ``prompt_rows`` names, for each sequence, the
  shard-local row whose prompt positions were packed (itself unless its prompt was
  shared).

Rows are grouped into micro-batches of at most ``max_rows_per_micro`` rows on
each data-parallel shard (a token budget of ``max_rows_per_micro x row_len``):
as few micro-batches as that allows, each with the same number of rows, rounded
up to a small set of sizes (1, 2, 3, 4, 6, 8, 12, ...: two per octave, see
``row_buckets``) so that a run compiles each pass for at most
2 log2(max_rows_per_micro) + 1 shapes while empty rows stay below a third. Each
shard packs only the sequences it holds (batch rows are split over shards in
contiguous blocks), so a micro-batch never needs another shard's data.

Everything here is host NumPy; it runs once per mini-batch on a few integers per sequence.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlhf_jax.models.blockwise import BRANCH_BITS
from rlhf_jax.rollout.buckets import next_power_of_two

MIN_ROW_LEN = 64


MAX_BRANCHES = (1 << BRANCH_BITS) - 1


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Packed micro-batches of one (mini-)batch: rows (n_micro, dp x rows_per_micro, row_len) int32 and
    logit lists (n_micro, dp x list size) int32."""

    input_ids: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    logit_positions: np.ndarray  # positions of the states that predict a response token
    logit_targets: np.ndarray  # the grid cell each predicts (-1 on padding entries)
    logit_token_ids: np.ndarray  # the token each predicts (0 on padding entries)
    route_sources: np.ndarray  # (n_micro, dp x rows_per_micro, row_len): the sequence-grid cell of each position
    prompt_rows: np.ndarray  # (N,) the shard-local row whose prompt positions hold each sequence's prompt
    real_tokens: int  # prompt + response tokens of the batch's sequences
    placed_tokens: int  # tokens laid in the rows (fewer than real_tokens when prompts are shared)
    padded_tokens: int  # cells computed: n_micro x dp x rows_per_micro x row_len

    @property
    def num_micro(self) -> int:
        return self.input_ids.shape[0]

    def micro(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids[i], "positions": self.positions[i], "segment_ids": self.segment_ids[i],
                "logit_positions": self.logit_positions[i], "logit_targets": self.logit_targets[i],
                "logit_token_ids": self.logit_token_ids[i]}


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


def prompt_units(prompts: np.ndarray, prompt_mask: np.ndarray, r_len: np.ndarray, rows: np.ndarray, row_len: int,
                 share_prompts: bool) -> list[tuple[int, list[int]]]:
    """The shard's sequences as packing units (prompt row, response rows): with ``share_prompts`` the rows of
    ``rows`` whose prompts are equal share one copy of it, cut into as many units as needed to fit ``row_len``
    (and ``MAX_BRANCHES`` responses); otherwise one unit per row. Rows with an empty response are left out."""
    groups: dict[bytes, list[int]] = {}
    for i in rows:
        if r_len[i] == 0:
            continue
        key = prompts[i][prompt_mask[i].astype(bool)].tobytes() if share_prompts else int(i).to_bytes(8, "little")
        groups.setdefault(key, []).append(int(i))
    units = []
    for members in groups.values():
        p = int(prompt_mask[members[0]].sum())
        if p == 0:  # its first response token would have no state to be predicted from
            raise ValueError(f"row {members[0]} has an empty prompt; packing needs at least one prompt token")
        chunk, used = [], p
        for i in members:
            r = int(r_len[i])
            if p + r > row_len:
                raise ValueError(f"a sequence of {p + r} tokens does not fit a packed row of {row_len} tokens")
            if chunk and (used + r > row_len or len(chunk) == MAX_BRANCHES):
                units.append((chunk[0], chunk))
                chunk, used = [], p
            chunk.append(i)
            used += r
        units.append((chunk[0], chunk))
    return units


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
    share_prompts: bool = True,
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
    shard_units, shard_rows = [], []
    for s in range(dp):
        units = prompt_units(prompts, prompt_mask, r_len, np.arange(s * per_shard, (s + 1) * per_shard), row_len,
                             share_prompts)
        sizes = np.array([p_len[first] + r_len[members].sum() for first, members in units], np.int64)
        shard_units.append((units, sizes))
        shard_rows.append(first_fit_decreasing(sizes, row_len))
    n_micro, rows_per_micro = micro_layout(max(len(rows) for rows in shard_rows), max_rows_per_micro)

    shape = (n_micro, dp * rows_per_micro, row_len)
    ids = np.full(shape, pad_token_id, np.int32)
    pos = np.zeros(shape, np.int32)
    seg = np.zeros(shape, np.int32)
    sources = np.full(shape, -1, np.int32)
    P, T = prompts.shape[1], prompts.shape[1] + R  # the sequence grid: left-padded prompt, then the response
    prompt_rows = np.tile(np.arange(per_shard, dtype=np.int32), dp)
    cells = rows_per_micro * row_len
    logits: list[list[list[tuple[int, int, int]]]] = [[[] for _ in range(dp)] for _ in range(n_micro)]
    for s, ((units, sizes), rows) in enumerate(zip(shard_units, shard_rows)):
        for m, group in enumerate(deal_rows(rows, sizes, n_micro, rows_per_micro)):
            for k, row in enumerate(group):
                out_row, col = s * rows_per_micro + k, 0
                for u, unit in enumerate(row, start=1):
                    first, members = units[unit]
                    base, p = u << BRANCH_BITS, int(p_len[first])
                    ids[m, out_row, col:col + p] = prompts[first][prompt_mask[first].astype(bool)]
                    pos[m, out_row, col:col + p] = np.arange(p)
                    seg[m, out_row, col:col + p] = base
                    sources[m, out_row, col:col + p] = (first - s * per_shard) * T + P - p + np.arange(p)
                    prompt_last, col = k * row_len + col + p - 1, col + p
                    for branch, i in enumerate(members, start=1):
                        r = int(r_len[i])
                        ids[m, out_row, col:col + r] = responses[i, :r]
                        pos[m, out_row, col:col + r] = p + np.arange(r)
                        seg[m, out_row, col:col + r] = base | branch
                        sources[m, out_row, col:col + r] = (i - s * per_shard) * T + P + np.arange(r)
                        prompt_rows[i] = first - s * per_shard
                        # Response token 0 is predicted by the prompt's last state, token t by the state of t - 1.
                        cell = (i - s * per_shard) * R
                        at = k * row_len + col - 1 + np.arange(r)
                        at[0] = prompt_last
                        logits[m][s].extend(zip(at.tolist(), range(cell, cell + r), responses[i, :r].tolist()))
                        col += r
    return PackedBatch(ids, pos, seg, *compact_logits(logits, cells), route_sources=sources, prompt_rows=prompt_rows,
                       real_tokens=int((p_len + r_len).sum()), placed_tokens=int((seg > 0).sum()),
                       padded_tokens=int(np.prod(shape)))


LOGIT_STEPS = 16  # the list's granularity: sixteenths of a micro-batch's cells


def logit_list_size(count: int, cells: int) -> int:
    """Entries of the compact logit list for ``count`` predicted positions among a shard's ``cells``: a size
    from ``row_buckets`` in sixteenths of the cells (1/16, 2/16, 3/16, 4/16, 6/16, ..., 16/16), so at most
    8 sizes per micro-batch shape, and beyond 2/16 at most a third of the list is padding."""
    unit = max(1, cells // LOGIT_STEPS)
    return unit * next(b for b in row_buckets(-(-cells // unit)) if b * unit >= count)


def compact_logits(entries: list[list[list[tuple[int, int, int]]]], cells: int) -> tuple[np.ndarray, ...]:
    """(positions, targets, token ids) lists per micro-batch and shard, padded to one bucketed size with
    (0, -1, 0) entries."""
    n_micro, dp = len(entries), len(entries[0])
    size = logit_list_size(max([len(e) for micro in entries for e in micro] + [1]), cells)
    lists = np.zeros((3, n_micro, dp, size), np.int32)
    lists[1] = -1
    for m, micro in enumerate(entries):
        for s, triples in enumerate(micro):
            if triples:
                lists[:, m, s, :len(triples)] = np.array(triples, np.int32).T
    return tuple(x.reshape(n_micro, dp * size) for x in lists)
