"""Supervised fine-tuning data: (prompt, response) pairs or chat conversations as token ids with a loss mask.

Two row layouts (verl's ``sft_trainer`` names):

- single turn: a prompt column (``data.prompt_key``; a string or chat messages, rendered exactly as RL prompts
  are, see :mod:`rlhf_jax.data.prompts`) and a response column (``data.response_key``); the response is
  followed by the tokenizer's EOS token, as in verl. Unset keys are recognised by name, so seed files with
  ``Question`` / ``Answer`` and verl's RL parquet (the ground truth is the target) need no keys.
- multi-turn (``data.multiturn.enable``): a list of role/content messages (``data.multiturn.messages_key``),
  rendered with the chat template; the loss covers the content of every assistant message (``data.multiturn.train_on``
  all; last: the final one only) and the template's end-of-turn after it, never the role headers nor the other
  messages.

An example is laid out like an RL sample: the tokens before the first trained token are its *prompt*, the rest
its *response* with a loss mask (holes at the user turns of a conversation). Examples longer than
``data.max_length`` follow ``data.truncation``: error, left (keep the end) or right (keep the start).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlhf_jax.data.loader import PromptLoader, read_rows
from rlhf_jax.data.prompts import _tokenize, bucket_length, pad_left, pad_token_id_of, render_prompt
from rlhf_jax.data.records import PROMPT_COLUMNS, _as_messages, _recognise, parse_prompt
from rlhf_jax.data.sources import DataError, Row, get_path

log = logging.getLogger(__name__)

# Tried in order when data.response_key is unset (any case); verl's RL parquet keeps its target as the ground truth.
RESPONSE_COLUMNS = ("response", "answer", "completion", "output", "reward_model.ground_truth")
SFT_TRUNCATION = ("error", "left", "right")


@dataclasses.dataclass
class SFTDataset:
    """Tokenized examples: per row the prompt ids, the response ids and the response's loss mask."""

    prompts: list[np.ndarray]
    responses: list[np.ndarray]
    loss_masks: list[np.ndarray]
    where: list[str]

    def __len__(self) -> int:
        return len(self.prompts)


def _response_text(row: Row, key: str | None) -> str:
    data = row.data
    if key is None:
        key = _recognise(data, RESPONSE_COLUMNS)
        if key is None:
            raise DataError(f"{row.where}: no response column (tried {', '.join(RESPONSE_COLUMNS)}, any case); row "
                            f"has columns {sorted(data)}; name it with data.response_key")
    try:
        value = get_path(data, key)
    except KeyError:
        raise DataError(f"{row.where}: missing response column {key!r} (data.response_key); row has columns "
                        f"{sorted(data)}") from None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{row.where}: response column {key!r} must be a string, got {type(value).__name__}")
    return str(value)


def _single_turn(row: Row, tokenizer, settings: dict) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of prompt + response + EOS."""
    key = settings["prompt_key"] or _recognise(row.data, PROMPT_COLUMNS)
    if key is None:
        raise DataError(f"{row.where}: no prompt column (tried {', '.join(PROMPT_COLUMNS)}, any case); row has "
                        f"columns {sorted(row.data)}; name it with data.prompt_key")
    try:
        raw = get_path(row.data, key)
    except KeyError:
        raise DataError(f"{row.where}: missing prompt column {key!r} (data.prompt_key); row has columns "
                        f"{sorted(row.data)}") from None
    prompt = parse_prompt(raw, row.where, key, from_csv=row.file.lower().endswith(".csv"))
    text, special = render_prompt(prompt, tokenizer, settings["template"], settings["system_prompt"],
                                  settings["chat_kwargs"])
    response = _response_text(row, settings["response_key"]) + (tokenizer.eos_token or "")
    prompt_ids = _tokenize(tokenizer, [text], special)[0]
    response_ids = _tokenize(tokenizer, [response], False)[0]
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def _render(tokenizer, messages: list, settings: dict, generation: bool = False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False,
                                         **settings["chat_kwargs"])


def _multi_turn(row: Row, tokenizer, settings: dict) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a conversation: each message's text is the template's rendering of the conversation up
    to it minus the rendering before it, so the pieces concatenate to the whole rendered conversation."""
    key = settings["messages_key"]
    try:
        value = get_path(row.data, key)
    except KeyError:
        raise DataError(f"{row.where}: missing conversation column {key!r} (data.multiturn.messages_key); row has "
                        f"columns {sorted(row.data)}") from None
    messages = _as_messages(value, row.where, key)
    if messages is None:
        raise DataError(f"{row.where}: column {key!r} must be a list of role/content messages, got "
                        f"{type(value).__name__}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{row.where}: conversation {key!r} has no assistant message to train on")
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("data.multiturn.enable needs a tokenizer with a chat template (data.chat_template)")
    # train_on=last: only the final assistant message is a target; the turns before it are context
    answers = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    trained = set(answers) if settings.get("train_on", "all") == "all" else {answers[-1]}
    pieces: list[tuple[str, int]] = []
    before = ""
    for k, message in enumerate(messages):
        full = _render(tokenizer, messages[:k + 1], settings)
        head = _render(tokenizer, messages[:k], settings, generation=True) if message["role"] == "assistant" else before
        if not (head.startswith(before) and full.startswith(head)):
            raise DataError(f"{row.where}: the chat template renders message {k} of {key!r} so that the conversation "
                            "before it is not a prefix of the conversation with it (a template that rewrites "
                            "earlier turns); use data.chat_template with a template that appends")
        pieces += [(head[len(before):], 0), (full[len(head):], int(k in trained))]
        before = full
    ids, mask = [], []
    texts = [text for text, _ in pieces if text]
    flags = [flag for text, flag in pieces if text]
    for piece, flag in zip(_tokenize(tokenizer, texts, False), flags):
        ids += piece
        mask += [flag] * len(piece)
    return ids, mask


def _truncate(ids: list[int], mask: list[int], max_length: int, mode: str, where: str):
    if len(ids) <= max_length:
        return ids, mask
    if mode == "left":
        return ids[-max_length:], mask[-max_length:]
    if mode == "right":
        return ids[:max_length], mask[:max_length]
    raise DataError(f"{where}: {len(ids)} tokens, longer than data.max_length={max_length}; raise data.max_length "
                    "or set data.truncation to left or right")


def split_example(ids: Sequence[int], mask: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(prompt, response, response loss mask) with the prompt ending just before the first trained token (at least
    one token: the first token of a sequence has no state to predict it from); None when nothing is trained."""
    mask = list(mask)
    if mask and mask[0]:
        mask[0] = 0
    first = next((i for i, m in enumerate(mask) if m), None)
    if first is None:
        return None
    arr = lambda xs: np.asarray(xs, np.int32)  # noqa: E731
    return arr(ids[:first]), arr(ids[first:]), arr(mask[first:])


def build_sft_dataset(rows: Sequence[Row], tokenizer, *, settings: dict, max_length: int,
                      truncation: str) -> SFTDataset:
    """Tokenize every row up front (bad rows fail here, naming file and row)."""
    if truncation not in SFT_TRUNCATION:
        raise DataError(f"data.truncation={truncation!r}: SFT examples are truncated error, left or right")
    out = SFTDataset([], [], [], [])
    dropped = []
    for row in rows:
        make = _multi_turn if settings["multiturn"] else _single_turn
        ids, mask = make(row, tokenizer, settings)
        parts = split_example(*_truncate(ids, mask, max_length, truncation, row.where))
        if parts is None:  # truncation removed every trained token
            dropped.append(row.where)
            continue
        for store, value in zip((out.prompts, out.responses, out.loss_masks), parts):
            store.append(value)
        out.where.append(row.where)
    if dropped:
        log.warning("data.truncation=%s left no response token in %d of %d examples (first: %s); they are skipped",
                    truncation, len(dropped), len(rows), dropped[0])
    if not out.prompts:
        raise DataError(f"no SFT example keeps a response token within data.max_length={max_length}")
    return out


def sft_settings(data_cfg: Any, tools: list[dict] | None = None) -> dict:
    """The row settings of a ``cfg.data`` section; ``tools`` (function schemas) reach the chat template as they do
    for the multi-turn rollout's prompts, so a warm-up on tool-call conversations sees the prompt it will be
    sampled from."""
    return {
        "prompt_key": data_cfg.prompt_key, "response_key": data_cfg.response_key,
        "multiturn": bool(data_cfg.multiturn.enable), "messages_key": data_cfg.multiturn.messages_key,
        "train_on": data_cfg.multiturn.get("train_on", "all"),
        "template": data_cfg.prompt_template, "system_prompt": data_cfg.system_prompt or None,
        "chat_kwargs": {**dict(data_cfg.apply_chat_template_kwargs or {}), **({"tools": tools} if tools else {})},
    }


def max_length_of(data_cfg: Any) -> int:
    """data.max_length, or prompt + response lengths when unset."""
    if data_cfg.max_length is not None:
        return int(data_cfg.max_length)
    return int(data_cfg.max_prompt_length) + int(data_cfg.max_response_length)


def sft_dataset_from_config(data_cfg: Any, tokenizer, which: str = "train",
                            tools: list[dict] | None = None) -> SFTDataset:
    """The train or val SFTDataset of a (finalized) ``cfg.data`` section (``tools``: see :func:`sft_settings`)."""
    files = data_cfg[f"{which}_files"]
    if not files:
        raise DataError(f"data.{which}_files is not set")
    shuffle = which == "train" and data_cfg.shuffle
    rows = read_rows(files, data_cfg[f"{which}_split"], int(data_cfg[f"{which}_max_samples"]),
                     int(data_cfg.seed) if shuffle else None)
    return build_sft_dataset(rows, tokenizer, settings=sft_settings(data_cfg, tools),
                             max_length=max_length_of(data_cfg), truncation=data_cfg.truncation)


@dataclasses.dataclass
class SFTBatch:
    """This process's rows of one batch: left-padded prompts, right-padded responses, the loss mask."""

    prompts: np.ndarray  # int32 (b, P)
    prompt_mask: np.ndarray  # int32 (b, P)
    responses: np.ndarray  # int32 (b, R)
    response_mask: np.ndarray  # int32 (b, R): real tokens
    loss_mask: np.ndarray  # int32 (b, R): trained tokens
    epoch: int
    step: int


class SFTLoader(PromptLoader):
    """The prompt loader's grain pipeline (seeded shuffle per epoch, exact resume through ``get_state``) over SFT
    examples. Widths are power-of-two buckets of the *global* batch's longest prompt and response, so every process
    pads alike; ``row_multiple`` pads this process's rows (a validation batch's remainder) with empty rows."""

    def __init__(self, dataset: SFTDataset, batch_size: int, *, pad_token_id: int, max_length: int,
                 row_multiple: int = 1, **kwargs):
        self.row_multiple = max(int(row_multiple), 1)
        super().__init__(dataset, batch_size, pad_token_id=pad_token_id, max_prompt_length=max_length, **kwargs)

    def _collate(self, step: int, global_idx: np.ndarray) -> SFTBatch:
        ds = self.dataset
        global_idx = np.asarray(global_idx, dtype=np.int64)
        width_p = bucket_length(max(len(ds.prompts[i]) for i in global_idx), self.buckets)
        width_r = bucket_length(max(len(ds.responses[i]) for i in global_idx), self.buckets)
        share = -(-len(global_idx) // self.process_count)
        rows = -(-share // self.row_multiple) * self.row_multiple
        idx = self._host_share(global_idx)
        prompts, prompt_mask = pad_left([ds.prompts[i] for i in idx], width_p, self.pad_token_id)
        responses = np.full((rows, width_r), self.pad_token_id, np.int32)
        response_mask, loss_mask = np.zeros((rows, width_r), np.int32), np.zeros((rows, width_r), np.int32)
        for j, i in enumerate(idx):
            n = len(ds.responses[i])
            responses[j, :n], response_mask[j, :n], loss_mask[j, :n] = ds.responses[i], 1, ds.loss_masks[i]
        pad = rows - len(idx)  # empty rows: no real token, no loss
        prompts = np.concatenate([prompts, np.full((pad, width_p), self.pad_token_id, np.int32)])
        prompt_mask = np.concatenate([prompt_mask, np.zeros((pad, width_p), np.int32)])
        return SFTBatch(prompts, prompt_mask, responses, response_mask, loss_mask,
                        epoch=step // self.batches_per_epoch, step=step)


def sft_loader(data_cfg: Any, tokenizer, dataset: SFTDataset, which: str, *, row_multiple: int = 1,
               num_epochs: int | None = None) -> SFTLoader:
    """Train loader (shuffled per data.shuffle, full batches, ``num_epochs`` None = endless) or val loader (in
    order, one pass, data.val_batch_size rows a batch, default all)."""
    common = dict(pad_token_id=pad_token_id_of(tokenizer), max_length=max_length_of(data_cfg),
                  seed=int(data_cfg.seed), row_multiple=row_multiple)
    if which == "train":
        return SFTLoader(dataset, int(data_cfg.train_batch_size), shuffle=bool(data_cfg.shuffle),
                         num_epochs=num_epochs, drop_remainder=True, **common)
    return SFTLoader(dataset, int(data_cfg.val_batch_size or len(dataset)), shuffle=False, num_epochs=1,
                     drop_remainder=False, **common)
