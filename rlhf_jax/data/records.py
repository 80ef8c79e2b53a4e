"""Turning raw rows into examples: prompt, ground truth, data source and the rest of the row.

The prompt column (``data.prompt_key``) holds either a string or a list of chat
messages (``[{"role": ..., "content": ...}, ...]``, verl's and ROLL's
``messages`` layout). The ground truth is read with a dotted path
(``data.ground_truth_key``, e.g. ``reward_model.ground_truth`` as in verl's
preprocessed parquet). Left unset, both columns are recognised by name (see
``PROMPT_COLUMNS`` and ``GROUND_TRUTH_COLUMNS``, any case), so a plain
``{"Question": ..., "Answer": ...}`` file needs no keys, nor do the defaults of ROLL's ``data_args``
(``prompt`` / ``messages`` columns, ``instruction`` in its examples) and of Trinity-RFT's taskset
``format`` (``prompt_key`` "prompt", ``messages_key`` "messages", ``response_key`` "response" for the answer). A row without a
``data_source`` takes ``data.default_data_source``, else its file's name.
All other columns travel to the reward function inside ``extra_info`` (a row's
own ``extra_info`` keys win on name clashes).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from rlhf_jax.data.domains import DomainSpec
from rlhf_jax.data.sources import SUPPORTED_SUFFIXES, DataError, Row, get_path

Messages = list[dict[str, str]]

# Columns tried, in order, when data.prompt_key / data.ground_truth_key are unset (names match in any case).
PROMPT_COLUMNS = ("prompt", "messages", "question", "query", "problem", "instruction")
# "response" last: Trinity-RFT's taskset format names its answer column with response_key (default "response").
GROUND_TRUTH_COLUMNS = ("reward_model.ground_truth", "ground_truth", "answer", "solution", "target", "label",
                        "response")


@dataclasses.dataclass
class Example:
    """One prompt with everything the reward function needs."""

    prompt: str | Messages
    ground_truth: Any
    data_source: str
    extra_info: dict[str, Any]
    where: str  # "file row N", for error messages
    domain: str | None = None  # the row's domain when sampling by domain (data.domain_weights), else None


def _as_messages(value: Any, where: str, key: str) -> Messages | None:
    """Return `value` as a validated message list, or None when it is not list-shaped at all."""
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        return None
    if not value:
        raise DataError(f"{where}: prompt column {key!r} is an empty message list")
    out = []
    for j, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise DataError(
                f"{where}: prompt column {key!r} message {j} must be an object with string 'role' and "
                f"'content', got {msg!r:.120}"
            )
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


def parse_prompt(value: Any, where: str, key: str, from_csv: bool = False) -> str | Messages:
    """Validate a prompt cell: a string or a list of chat messages (JSON-encoded lists are accepted from CSV)."""
    if from_csv and isinstance(value, str) and value.lstrip().startswith("["):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, list) and decoded and all(isinstance(m, dict) and "role" in m for m in decoded):
            value = decoded
    messages = _as_messages(value, where, key)
    if messages is not None:
        if not any(m["content"].strip() for m in messages):
            raise DataError(f"{where}: prompt column {key!r} is empty (every message's content is blank)")
        return messages
    if isinstance(value, str):
        if not value.strip():  # nothing to condition on: the model would sample from the template alone
            raise DataError(f"{where}: prompt column {key!r} is empty")
        return value
    raise DataError(
        f"{where}: prompt column {key!r} must be a string or a list of chat messages, got {type(value).__name__}"
    )


def _recognise(data: dict[str, Any], candidates: Sequence[str]) -> str | None:
    """The first candidate column present in ``data`` (a dotted path, or a top-level name in any case)."""
    by_lower = {str(k).lower(): k for k in data}
    for name in candidates:
        if "." in name:
            try:
                get_path(data, name)
                return name
            except KeyError:
                continue
        if name in by_lower:
            return by_lower[name]
    return None


def _file_stem(file: str) -> str:
    """``/data/qa.json`` -> ``qa``: the data_source of rows that name none."""
    base = os.path.basename(str(file).rstrip("/"))
    for suffix in SUPPORTED_SUFFIXES:
        if base.lower().endswith(suffix):
            return base[: -len(suffix)]
    return base


def _has_media(value) -> bool:
    """A non-empty image/video cell (a list, an array or a path)."""
    if value is None:
        return False
    try:
        return len(value) > 0
    except TypeError:
        return True


def to_example(
    row: Row,
    prompt_key: str | None = None,
    ground_truth_key: str | None = None,
    default_data_source: str | None = None,
    media_keys: Sequence[str] = ("images", "videos"),
    domains: DomainSpec | None = None,
) -> Example:
    """Build an Example from a raw row, failing with the file, row and key on anything missing or malformed.

    ``prompt_key`` / ``ground_truth_key`` None: recognise the column by name; ``ground_truth_key=""``: no ground truth.
    A row with images or videos in a ``media_keys`` column is refused: the models are text-only, and training on
    the text without its pictures would be training on another task. ``domains``: read the row's domain.
    """
    data = row.data
    for key in media_keys:
        if key and _has_media(data.get(key)):
            raise DataError(f"{row.where}: column {key!r} holds images/videos (data.image_key / data.video_key); "
                            "multi-modal prompts are not supported: use text-only data")
    if prompt_key is None:
        prompt_key = _recognise(data, PROMPT_COLUMNS)
        if prompt_key is None:
            raise DataError(f"{row.where}: no prompt column (tried {', '.join(PROMPT_COLUMNS)}, any case); row has "
                            f"columns {sorted(data)}; name it with data.prompt_key")
    try:
        raw_prompt = get_path(data, prompt_key)
    except KeyError:
        raise DataError(
            f"{row.where}: missing prompt column {prompt_key!r} (data.prompt_key); row has columns {sorted(data)}"
        ) from None
    prompt = parse_prompt(raw_prompt, row.where, prompt_key, from_csv=row.file.lower().endswith(".csv"))

    ground_truth = None
    if ground_truth_key is None:
        ground_truth_key = _recognise(data, GROUND_TRUTH_COLUMNS)
        if ground_truth_key is None:
            raise DataError(
                f"{row.where}: no ground-truth column (tried {', '.join(GROUND_TRUTH_COLUMNS)}, any case); row has "
                f"columns {sorted(data)}; name it with data.ground_truth_key (or set it to '' for data without one)")
    if ground_truth_key:
        try:
            ground_truth = get_path(data, ground_truth_key)
        except KeyError:
            raise DataError(
                f"{row.where}: missing ground-truth column {ground_truth_key!r} (data.ground_truth_key; set it to "
                f"'' for data without one); row has columns {sorted(data)}"
            ) from None

    data_source = data.get("data_source", default_data_source or _file_stem(row.file))
    if not isinstance(data_source, str):
        raise DataError(f"{row.where}: 'data_source' must be a string, got {type(data_source).__name__}")

    own_extra = data.get("extra_info")
    if own_extra is not None and not isinstance(own_extra, dict):
        raise DataError(f"{row.where}: 'extra_info' must be an object, got {type(own_extra).__name__}")
    prompt_root = prompt_key if prompt_key in data else prompt_key.split(".")[0]
    extra = {k: v for k, v in data.items() if k not in (prompt_root, "extra_info", "data_source")}
    extra.update(own_extra or {})
    domain = domains.domain_of(data, row.where) if domains is not None else None
    return Example(prompt=prompt, ground_truth=ground_truth, data_source=data_source, extra_info=extra, where=row.where,
                   domain=domain)


def to_examples(
    rows: Sequence[Row],
    prompt_key: str | None = None,
    ground_truth_key: str | None = None,
    default_data_source: str | None = None,
    media_keys: Sequence[str] = ("images", "videos"),
    domains: DomainSpec | None = None,
) -> list[Example]:
    """Convert all rows (eagerly, so that bad data fails before training starts)."""
    return [to_example(r, prompt_key, ground_truth_key, default_data_source, media_keys, domains) for r in rows]
