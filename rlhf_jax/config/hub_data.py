"""The syntax of a Hugging Face dataset named in ``data.train_files`` / ``data.val_files``.

``hf:<org>/<name>`` names a dataset on the Hub, read with the ``datasets`` library (from its local cache with
``HF_HUB_OFFLINE=1`` or ``HF_DATASETS_OFFLINE=1``). A query picks the rest, as ``datasets.load_dataset``
takes it: ``hf:openai/gsm8k?subset=main`` (the configuration, load_dataset's ``name``),
``&split=test`` (else data.train_split / data.val_split), ``&revision=<branch, tag or commit>``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

PREFIX = "hf:"
QUERY_KEYS = ("subset", "split", "revision")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class HubDataset(NamedTuple):
    repo_id: str
    subset: str | None
    split: str | None
    revision: str | None


def is_hub_dataset(entry) -> bool:
    """True for an ``hf:`` entry."""
    return isinstance(entry, str) and entry.startswith(PREFIX)


def parse(entry: str) -> HubDataset:
    """The parts of an ``hf:`` entry; ValueError naming the entry for a malformed one."""
    body, _, query = entry[len(PREFIX):].partition("?")
    if not _ID.match(body) or ".." in body:
        raise ValueError(f"{entry!r} does not name a dataset: write hf:<org>/<name>[?subset=...&split=...]")
    parts: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if key not in QUERY_KEYS or not eq or not value:
            raise ValueError(f"{entry!r}: {item!r} is not one of {', '.join(k + '=<value>' for k in QUERY_KEYS)}")
        parts[key] = value
    return HubDataset(body, parts.get("subset"), parts.get("split"), parts.get("revision"))


def spec(repo_id: str, subset: str | None = None, split: str | None = None) -> str:
    """The ``hf:`` entry of a dataset id with an optional subset and split."""
    query = "&".join(f"{k}={v}" for k, v in (("subset", subset), ("split", split)) if v)
    return PREFIX + repo_id + (f"?{query}" if query else "")
