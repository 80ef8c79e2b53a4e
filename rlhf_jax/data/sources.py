"""Reading prompt datasets from parquet, JSON, JSONL and CSV files.

Every supported layout is reduced to a list of plain-Python rows (dicts), each
tagged with the file and 0-based row number it came from so that later checks
can name them in errors:

- parquet (verl's preprocessed files; nested structs become dicts),
- JSONL (one object per line),
- JSON: a list of row objects, an object of splits such as
  ``{"train": [{"Question": ..., "Answer": ...}], "test": [...]}`` (read by
  split), or a column-oriented object ``{"col": [v0, v1, ...], ...}``,
- CSV with a header row (cells stay strings),
- a directory: its supported files, restricted to those whose name starts with
  the split name when any does (the layout of Trinity-RFT's file tasksets),
- ``builtin:arithmetic`` / ``builtin:countdown`` / ``builtin:word_problems`` /
  ``builtin:arithmetic_preferences`` (DPO pairs) / ``builtin:calculator_demos`` (tool-call conversations): the
  synthetic tasks of :mod:`rlhf_jax.data.synthetic`, generated in memory (split ``train``: 1000 rows,
  seed 0; any other split: 100 rows, seed 1). Generator knobs can follow as a
  query, e.g. ``builtin:arithmetic?max_value=20&ops=+-&train_size=5000``,
- ``hf:<org>/<name>[?subset=...&split=...&revision=...]``: a Hugging Face dataset, read by :mod:`rlhf_jax.data.hub`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from rlhf_jax.config.hub_data import is_hub_dataset

SUPPORTED_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")


class DataError(ValueError):
    """A dataset problem, with the file (and row / key where known) in the message."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One raw dataset row and where it came from."""

    data: dict[str, Any]
    file: str
    index: int  # 0-based row number within `file` (within the split for split-JSON)

    @property
    def where(self) -> str:
        return f"{self.file} row {self.index}"


def _format_of(path: str) -> str:
    lower = path.lower()
    for suffix in SUPPORTED_SUFFIXES:
        if lower.endswith(suffix):
            return suffix[1:]
    raise DataError(
        f"{path}: unsupported file type; expected one of {', '.join(SUPPORTED_SUFFIXES)} "
        "(or a directory containing such files)"
    )


def _read_parquet(path: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several error types for corrupt files
        raise DataError(f"{path}: cannot read as parquet: {e}") from e
    return table.to_pylist()


def _read_jsonl(path: str, text: str) -> list[dict[str, Any]]:
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {lineno} is not valid JSON: {e.msg}") from e
    return rows


def _is_column_oriented(obj: dict[str, Any]) -> bool:
    values = list(obj.values())
    return bool(values) and all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1 \
        and not all(v and isinstance(v[0], dict) for v in values)


def _read_json(path: str, text: str, split: str | None) -> list[dict[str, Any]]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # a .json file that holds JSON lines
            return _read_jsonl(path, text)
        raise DataError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from e
    if isinstance(obj, list):
        return obj
    if not isinstance(obj, dict):
        raise DataError(f"{path}: top-level JSON must be a list of rows or an object, got {type(obj).__name__}")
    split_like = {k: v for k, v in obj.items() if isinstance(v, list) and (not v or isinstance(v[0], dict))}
    if split_like and len(split_like) == len(obj):
        if split is None:
            raise DataError(f"{path}: file holds splits {sorted(obj)}; choose one with data.train_split / data.val_split")
        if split not in obj:
            raise DataError(
                f"{path}: split {split!r} not found; the file has splits {sorted(obj)} "
                "(set data.train_split / data.val_split)"
            )
        return obj[split]
    if _is_column_oriented(obj):
        names = list(obj)
        return [{k: obj[k][i] for k in names} for i in range(len(obj[names[0]]))]
    raise DataError(
        f"{path}: top-level JSON object is neither an object of splits (each a list of rows) "
        f"nor column-oriented; keys: {sorted(obj)[:10]}"
    )


def _read_csv(path: str, text: str) -> list[dict[str, Any]]:
    reader = csv.DictReader(text.splitlines())
    if reader.fieldnames is None:
        return []
    rows = []
    for i, row in enumerate(reader):
        if None in row:
            raise DataError(f"{path}: row {i} has more cells than the header ({len(reader.fieldnames)} columns)")
        rows.append(dict(row))
    return rows


def _expand_directory(path: str, split: str | None) -> list[str]:
    try:
        names = os.listdir(path)
    except OSError as e:
        raise DataError(f"{path}: cannot list directory: {e}") from e
    files = sorted(
        os.path.join(path, name) for name in names
        if name.lower().endswith(SUPPORTED_SUFFIXES) and os.path.isfile(os.path.join(path, name))
    )
    if not files:
        raise DataError(f"{path}: directory contains no {'/'.join(SUPPORTED_SUFFIXES)} files")
    if split:
        matching = [f for f in files if os.path.basename(f).lower().startswith(split.lower())]
        if matching:
            return matching
    return files


BUILTIN_PREFIX = "builtin:"
_INT_KNOBS = ("min_value", "max_value", "num_terms", "num_numbers", "max_number", "max_target", "max_steps", "seed", "max_offset",
              "min_factor", "max_factor",
              "train_size", "test_size")


def _read_builtin(spec: str, split: str | None) -> list[dict[str, Any]]:
    from rlhf_jax.data import synthetic

    task, _, query = spec[len(BUILTIN_PREFIX):].partition("?")
    makers = synthetic.GENERATORS
    if task not in makers:
        raise DataError(f"{spec}: unknown builtin dataset {task!r}; known: {sorted(makers)}")
    knobs: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        try:
            knobs[key] = int(value) if key in _INT_KNOBS else value
        except ValueError:
            raise DataError(f"{spec}: knob {key!r} needs an integer, got {value!r}") from None
    train = (split or "train") == "train"
    seed = knobs.pop("seed", 0) + (0 if train else 1)
    size = knobs.pop("train_size", 1000), knobs.pop("test_size", 100)
    try:
        return makers[task](size[0] if train else size[1], seed, split=split or "train", **knobs)
    except (TypeError, ValueError) as e:
        raise DataError(f"{spec}: {e}") from None


def read_file(path: str, split: str | None = None) -> list[Row]:
    """Read one file (or directory, builtin:<task>, or hf:<dataset>) into rows; `split` selects from split-JSON,
    directories and Hub datasets."""
    if str(path).startswith(BUILTIN_PREFIX):
        return [Row(rec, str(path), i) for i, rec in enumerate(_read_builtin(str(path), split))]
    if is_hub_dataset(str(path)):
        from rlhf_jax.data import hub

        try:
            records = hub.read_hub(str(path), split)
        except hub.DataError as e:
            raise DataError(str(e)) from None
        if not records:
            raise DataError(f"{path}: contains no rows")
        return [Row(rec, str(path), i) for i, rec in enumerate(records)]
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):
        return [row for f in _expand_directory(path, split) for row in read_file(f, split)]
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found")
    fmt = _format_of(path)
    if fmt == "parquet":
        records = _read_parquet(path)
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: cannot read as UTF-8 text: {e}") from e
        if fmt == "jsonl":
            records = _read_jsonl(path, text)
        elif fmt == "json":
            records = _read_json(path, text, split)
        else:
            records = _read_csv(path, text)
    if not records:
        raise DataError(f"{path}: contains no rows" + (f" in split {split!r}" if split and fmt == "json" else ""))
    out = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise DataError(f"{path}: row {i} is a {type(rec).__name__}, expected an object with named columns")
        out.append(Row(rec, path, i))
    return out


def read_files(paths: str | Sequence[str], split: str | None = None) -> list[Row]:
    """Read and concatenate one or several files (verl's data.train_files / data.val_files)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [str(p) for p in paths]
    if not paths:
        raise DataError("no data files given (data.train_files / data.val_files is empty)")
    return [row for p in paths for row in read_file(p, split)]


_MISSING = object()


def get_path(row: dict[str, Any], dotted: str, default: Any = _MISSING) -> Any:
    """Look up 'a.b.c' in nested dicts; a literal key containing dots wins over the nested reading."""
    if dotted in row:
        return row[dotted]
    node: Any = row
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            if default is _MISSING:
                raise KeyError(dotted)
            return default
    return node
