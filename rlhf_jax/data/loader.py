"""The prompt loader: a grain pipeline over pre-tokenized prompts, checkpointable with Orbax.

Pipeline (a ``grain.MapDataset``, so every batch is a pure function of its index):
row indices -> per-epoch shuffle (seeded, reshuffled each epoch) -> global batches
of ``data.train_batch_size`` (the last partial batch dropped for training) ->
repeat for the epochs -> this process's contiguous slice of each global batch ->
left-padded numpy batch. With ``data.domain_weights`` the shuffled global batches are replaced by
per-domain shares (:mod:`rlhf_jax.data.domains`), still one pure function of the batch number. Every process walks the same global order and takes a
disjoint share of each batch, so the union over processes is exactly what a
single process would see. The iterator state is grain's ``{"next_index": k}``,
saved by Orbax with ``grain.checkpoint.CheckpointSave(loader.grain_iterator)``;
after a restore the next batch is batch k of the uninterrupted run, including
when k falls on an epoch boundary.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from rlhf_jax.parallel import groups
from rlhf_jax.data.domains import DomainPlan, DomainSpec
from rlhf_jax.data.prompts import bucket_length, pad_left, pad_token_id_of, resolve_buckets, tokenize_examples
from rlhf_jax.data.records import Example, to_examples
from rlhf_jax.data.sources import DataError, read_files
from rlhf_jax.types import PromptBatch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PromptDataset:
    """Validated, tokenized prompts held in memory (unpadded int32 ids, one array per row)."""

    examples: list[Example]
    input_ids: list[np.ndarray]
    prompt_texts: list[str]

    def __len__(self) -> int:
        return len(self.examples)


def read_rows(files: str | Sequence[str], split: str | None, max_samples: int = -1,
              sample_seed: int | None = None) -> list:
    """The rows of ``files``; ``max_samples`` > 0 keeps that many: a random subset drawn with ``sample_seed``, or
    the first rows when it is None (verl's train/val_max_samples)."""
    rows = read_files(list(files) if not isinstance(files, str) else files, split)
    if 0 < max_samples < len(rows):
        if sample_seed is None:
            return rows[:max_samples]
        keep = np.random.default_rng(sample_seed).choice(len(rows), max_samples, replace=False)
        rows = [rows[i] for i in sorted(keep)]
    return rows


def build_dataset(
    files: str | Sequence[str],
    tokenizer: Any,
    *,
    split: str | None = None,
    prompt_key: str | None = None,
    ground_truth_key: str | None = None,
    default_data_source: str | None = None,
    max_prompt_length: int = 512,
    prompt_template: str = "native",
    system_prompt: str | None = None,
    truncation: str = "error",
    filter_overlong_prompts: bool = False,
    max_samples: int = -1,
    sample_seed: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    media_keys: Sequence[str] = ("images", "videos"),
    domains: DomainSpec | None = None,
) -> PromptDataset:
    """Read, validate and tokenize every prompt of `files` (all errors surface here, before training).

    ``max_samples`` > 0 keeps that many rows: a random subset drawn with ``sample_seed``, or the first rows
    when it is None (verl's train/val_max_samples). ``domains``: read each row's domain (sampling by domain).
    """
    rows = read_rows(files, split, max_samples, sample_seed)
    examples = to_examples(rows, prompt_key, ground_truth_key, default_data_source, media_keys, domains)
    kept, ids, texts = tokenize_examples(
        examples, tokenizer, max_prompt_length=max_prompt_length, template=prompt_template,
        system_prompt=system_prompt, truncation=truncation, filter_overlong_prompts=filter_overlong_prompts,
        chat_template_kwargs=chat_template_kwargs,
    )
    return PromptDataset(kept, ids, texts)


def _process_index_and_count() -> tuple[int, int]:
    return groups.process_index(), groups.process_count()


class PromptLoader:
    """Iterates PromptBatch objects; `get_state`/`set_state` (or Orbax via `grain_iterator`) resume exactly."""

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        *,
        pad_token_id: int,
        max_prompt_length: int,
        buckets: Sequence[int] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_epochs: int | None = 1,
        drop_remainder: bool = True,
        process_index: int | None = None,
        process_count: int | None = None,
        domain_weights: dict[str, float] | None = None,
    ):
        """``domain_weights`` {domain: weight}: each batch takes fixed per-domain shares (the dataset's examples
        carry their domain); training batches only."""
        if process_index is None or process_count is None:
            process_index, process_count = _process_index_and_count()
        if batch_size <= 0:
            raise DataError(f"batch size must be positive, got {batch_size}")
        if drop_remainder and batch_size % process_count:
            raise DataError(
                f"data.train_batch_size={batch_size} must be divisible by the number of processes ({process_count})"
            )
        self.domains = None
        if domain_weights:
            if not drop_remainder:
                raise DataError("sampling by domain (data.domain_weights) makes full training batches only")
            self.domains = DomainPlan([e.domain for e in dataset.examples], domain_weights, batch_size, seed=seed,
                                      shuffle=shuffle)
        n = len(dataset) if self.domains is None else self.domains.num_rows  # an epoch: as many rows as there are
        self.batches_per_epoch = n // batch_size if drop_remainder else -(-n // batch_size)
        if self.batches_per_epoch == 0:
            raise DataError(f"dataset has {n} prompts, fewer than one batch of {batch_size}")
        if drop_remainder and n % batch_size:
            log.info("loader drops the last %d of %d prompts each epoch (partial batch)", n % batch_size, n)
        self.dataset = dataset
        self.batch_size = batch_size
        self.pad_token_id = int(pad_token_id)
        self.buckets = resolve_buckets(max_prompt_length, buckets)
        self.num_epochs = num_epochs
        self.process_index, self.process_count = process_index, process_count

        if self.domains is not None:
            plan = self.domains
            ds = grain.MapDataset.range(self.batches_per_epoch).repeat(num_epochs)
            self._grain_dataset = ds.map_with_index(lambda step, _: self._collate(step, plan.batch(step)))
        else:
            ds = grain.MapDataset.range(n)
            if shuffle:
                ds = ds.shuffle(seed=int(seed))
            ds = ds.batch(batch_size, drop_remainder=drop_remainder).repeat(num_epochs)
            self._grain_dataset = ds.map_with_index(self._collate)
        self._grain_iterator = self._grain_dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        ).__iter__()

    def _host_share(self, idx: np.ndarray) -> np.ndarray:
        return np.array_split(idx, self.process_count)[self.process_index]

    def _collate(self, step: int, global_idx: np.ndarray) -> PromptBatch:
        idx = self._host_share(np.asarray(global_idx, dtype=np.int64))
        ids = [self.dataset.input_ids[i] for i in idx]
        length = bucket_length(max((len(r) for r in ids), default=1), self.buckets)
        input_ids, mask = pad_left(ids, length, self.pad_token_id)
        exs = [self.dataset.examples[i] for i in idx]
        return PromptBatch(
            input_ids=input_ids, attention_mask=mask,
            data_source=[e.data_source for e in exs], ground_truth=[e.ground_truth for e in exs],
            extra_info=[dict(e.extra_info) for e in exs], raw_prompt=[e.prompt for e in exs],
            prompt_text=[self.dataset.prompt_texts[i] for i in idx], index=idx,
            epoch=step // self.batches_per_epoch, step=step,
            domain=None if self.domains is None else self.domains.domain_ids[idx],
        )

    @property
    def grain_iterator(self) -> grain.DatasetIterator:
        """The underlying grain iterator, for ``grain.checkpoint.CheckpointSave/CheckpointRestore``."""
        return self._grain_iterator

    def __iter__(self) -> PromptLoader:
        return self

    def __next__(self) -> PromptBatch:
        return next(self._grain_iterator)

    def __len__(self) -> int:
        """Batches in the whole run (all epochs)."""
        if self.num_epochs is None:
            raise TypeError("an infinite loader (num_epochs=None) has no length")
        return self.batches_per_epoch * self.num_epochs

    def get_state(self) -> dict[str, Any]:
        return self._grain_iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._grain_iterator.set_state(state)


def media_keys(data_cfg: Any) -> tuple[str, ...]:
    """The columns whose images or videos refuse a row (data.image_key, data.video_key; None = not checked)."""
    return tuple(k for k in (data_cfg.image_key, data_cfg.video_key) if k)


def domain_spec(data_cfg: Any) -> DomainSpec | None:
    """How rows name their domain, when the training prompts are sampled by domain (data.domain_weights)."""
    d = data_cfg
    if not d.domain_weights:
        return None
    return DomainSpec(key=d.domain_key, tags=dict(d.domain_tags or {}), tag_key=d.tag_key, default=d.default_domain)


def dataset_from_config(data_cfg: Any, tokenizer: Any, which: str = "train",
                        tools: list[dict] | None = None) -> PromptDataset:
    """Build the train or val PromptDataset from the `data` section of a config (the key table's names and
    defaults); ``tools`` (function schemas) reach the chat template, which lists them in the prompt (multi-turn tool
    calling)."""
    if which not in ("train", "val"):
        raise ValueError(f"which must be 'train' or 'val', got {which!r}")
    d = data_cfg
    files = d[f"{which}_files"]
    if not files:
        raise DataError(f"data.{which}_files is not set")
    return build_dataset(
        list(files) if not isinstance(files, str) else files, tokenizer,
        split=d[f"{which}_split"],
        prompt_key=d.prompt_key,  # None: recognised by name
        ground_truth_key=d.ground_truth_key,  # None: recognised by name; "": none
        default_data_source=d.default_data_source,
        max_prompt_length=int(d.max_prompt_length),
        prompt_template=d.prompt_template,
        system_prompt=d.system_prompt or None,
        truncation=d.truncation,
        filter_overlong_prompts=bool(d.filter_overlong_prompts),
        max_samples=int(d[f"{which}_max_samples"]),
        chat_template_kwargs={**dict(d.apply_chat_template_kwargs or {}), **({"tools": tools} if tools else {})},
        media_keys=media_keys(d),
        domains=domain_spec(d) if which == "train" else None,
        sample_seed=int(d.seed) if which == "train" and d.shuffle else None,
    )


def loader_from_config(
    data_cfg: Any,
    tokenizer: Any,
    which: str = "train",
    *,
    num_epochs: int | None = 1,
    dataset: PromptDataset | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
) -> PromptLoader:
    """Train loader (shuffled per data.shuffle, full batches) or val loader (in order, one pass, all rows)."""
    dataset = dataset if dataset is not None else dataset_from_config(data_cfg, tokenizer, which)
    d = data_cfg
    common = dict(
        pad_token_id=pad_token_id_of(tokenizer), max_prompt_length=int(d.max_prompt_length),
        buckets=d.prompt_length_buckets, seed=int(d.seed), process_index=process_index, process_count=process_count,
    )
    if which == "train":
        return PromptLoader(dataset, int(d.train_batch_size), shuffle=bool(d.shuffle), num_epochs=num_epochs,
                            drop_remainder=True, domain_weights=dict(d.domain_weights or {}) or None, **common)
    batch_size = int(d.val_batch_size) if d.val_batch_size is not None else len(dataset)  # None = the whole set
    return PromptLoader(dataset, batch_size, shuffle=False, num_epochs=1, drop_remainder=False, **common)
