"""Rows of a Hugging Face dataset (an ``hf:`` entry of data.train_files / val_files) through ``datasets``.

Online, ``datasets.load_dataset`` downloads what it lacks; with ``HF_HUB_OFFLINE=1`` or ``HF_DATASETS_OFFLINE=1``
it reads the dataset's prepared copy in the datasets cache (``HF_DATASETS_CACHE``, else ``HF_HOME/datasets``), as
written by an earlier online load. Every failure is one line naming the entry.
"""

from __future__ import annotations

import os
from typing import Any

from rlhf_jax.config.hub_data import parse


class DataError(ValueError):
    """A Hub dataset that cannot be read (sources.py reports it as its DataError)."""

_TRUE = ("1", "true", "yes", "on")
_WHERE = "(an entry of data.train_files / data.val_files)"


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def read_hub(entry: str, split: str | None) -> list[dict[str, Any]]:
    """The rows of ``entry``'s split (the entry's own ``split=``, else ``split``, else train) as dicts."""
    try:
        ds_id = parse(entry)
    except ValueError as e:
        raise DataError(f"{e} {_WHERE}") from None
    try:
        import datasets
    except ImportError:
        raise DataError(f"{entry}: reading a Hub dataset needs the datasets package (pip install datasets)") from None
    split = ds_id.split or split or "train"
    try:
        table = datasets.load_dataset(ds_id.repo_id, ds_id.subset, split=split, revision=ds_id.revision)
    except (ConnectionError, OSError) as e:
        how = ("HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set, so no download was tried (unset it, or load it once "
               "online to fill the cache)" if _offline() else " ".join(str(e).split()))
        raise DataError(f"{entry}: dataset {ds_id.repo_id!r} could not be read: not in the datasets cache "
                        f"({os.environ.get('HF_DATASETS_CACHE') or 'HF_HOME/datasets'}) and {how} {_WHERE}") from None
    except ValueError as e:  # an unknown subset or split: datasets names the available ones
        raise DataError(f"{entry}: {' '.join(str(e).split())} {_WHERE}") from None
    except Exception as e:  # the hub's own errors (no such dataset, gated, ...)
        raise DataError(f"{entry}: {type(e).__name__}: {' '.join(str(e).split())} {_WHERE}") from None
    return table.to_list()
