"""The configuration schema: every key, its default, its type, its one-line doc.

The schema is a flat table of :class:`Key` entries (dotted verl-style paths),
declared section by section in :mod:`rlhf_jax.config.keys_policy` and
:mod:`rlhf_jax.config.keys_run`. From that one table come the locked
``ml_collections.ConfigDict`` the recipes start from (:func:`base_config`),
the docs a ``--help``-like printer and ``docs/CONFIG.md`` are generated from,
and the allowed values (``choices``) that validation checks.

A default of ``None`` means "derived in finalize" (the doc says from what);
such keys carry an explicit type so command-line overrides parse.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Any

from ml_collections import ConfigDict, config_dict

from rlhf_jax.config import keys_policy, keys_run
from rlhf_jax.config.key import Key

KEYS: tuple[Key, ...] = keys_run.DATA + keys_policy.KEYS + keys_run.KEYS


def _index() -> dict[str, Key]:
    return {k.path: k for k in KEYS}


def _check_table(keys: tuple[Key, ...]) -> None:
    seen: set[str] = set()
    for k in keys:
        if k.path in seen:
            raise RuntimeError(f"duplicate config key {k.path}")
        seen.add(k.path)
        if k.default is None and k.type is None:
            raise RuntimeError(f"config key {k.path} defaults to None and needs an explicit type")
        if not k.doc or "\n" in k.doc:
            raise RuntimeError(f"config key {k.path} needs a one-line doc")
        if k.choices is not None and k.default is not None:
            values = k.default if isinstance(k.default, tuple) else (k.default,)
            bad = [v for v in values if v not in k.choices]
            if bad:
                raise RuntimeError(f"config key {k.path}: default {k.default!r} not in choices {k.choices}")
    for p in seen:  # a leaf cannot also be a section
        if any(q.startswith(p + ".") for q in seen):
            raise RuntimeError(f"config key {p} is both a value and a section")


def base_config() -> ConfigDict:
    """A fresh, locked ConfigDict holding every schema key at its default.

    Locked: assigning a key that does not exist raises, so a typo in a recipe or
    an override fails instead of being ignored.
    """
    root = ConfigDict()
    for k in KEYS:
        *parents, leaf = k.path.split(".")
        node = root
        for p in parents:
            if p not in node:
                node[p] = ConfigDict()
            node = node[p]
        node[leaf] = config_dict.placeholder(k.type) if k.default is None else k.default
    root.lock()
    return root


def key_paths() -> tuple[str, ...]:
    """Every schema key, dotted, in declaration order."""
    return tuple(k.path for k in KEYS)


def get_key(path: str) -> Key:
    """The :class:`Key` at ``path``; an unknown path raises KeyError with a close-match suggestion."""
    index = _index()
    if path not in index:
        raise KeyError(unknown_key_message(path))
    return index[path]


def is_section(path: str) -> bool:
    """True if ``path`` names a section (a prefix of some key), e.g. ``actor_rollout_ref.actor``."""
    return any(k.path.startswith(path + ".") for k in KEYS)


def suggest(path: str, candidates: tuple[str, ...] | None = None) -> str | None:
    """The closest known key to ``path`` (difflib), matching whole paths and then the last component."""
    candidates = candidates if candidates is not None else key_paths()
    close = difflib.get_close_matches(path, candidates, n=1, cutoff=0.6)
    if close:
        return close[0]
    leaf = path.rsplit(".", 1)[-1]
    by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    return by_leaf[close[0]] if close else None


def unknown_key_message(path: str) -> str:
    """``unknown config key 'x' (did you mean 'y'?)``."""
    hint = suggest(path)
    return f"unknown config key {path!r}" + (f" (did you mean {hint!r}?)" if hint else "")


def iter_leaves(cfg: ConfigDict | dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) for every non-section value of ``cfg``."""
    for name in cfg.keys():
        value = cfg[name]
        path = f"{prefix}{name}"
        if isinstance(value, (ConfigDict, dict)) and path not in DOCS:  # a dict-valued key is one leaf
            yield from iter_leaves(value, path + ".")
        else:
            yield path, value


def get_path(cfg: ConfigDict, path: str) -> Any:
    """``cfg`` value at a dotted path."""
    node: Any = cfg
    for part in path.split("."):
        node = node[part]
    return node


def set_path(cfg: ConfigDict, path: str, value: Any) -> None:
    """Set ``cfg`` at a dotted path (type-checked by ConfigDict)."""
    *parents, leaf = path.split(".")
    node: Any = cfg
    for part in parents:
        node = node[part]
    node[leaf] = value


def check_known_keys(cfg: ConfigDict) -> None:
    """Raise ValueError naming any key of ``cfg`` that is not in the schema (e.g. added to an unlocked copy)."""
    known = set(key_paths())
    for path, _ in iter_leaves(cfg):
        if path not in known and not path.startswith("derived."):
            raise ValueError(unknown_key_message(path))


_check_table(KEYS)
DOCS: dict[str, str] = {k.path: k.doc for k in KEYS}
