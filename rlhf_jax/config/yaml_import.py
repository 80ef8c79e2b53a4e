"""Load a verl-style YAML file onto the schema.

- Nested sections map onto dotted schema keys (``actor_rollout_ref.actor.optim.lr``).
- ``${a.b.c}`` references are resolved against the YAML itself first, then the
  base config (so ``response_length: ${data.max_response_length}`` works).
- Keys that do not apply to JAX (``fsdp_config``, ``strategy``, vLLM settings,
  see :mod:`rlhf_jax.config.verl_compat`) are skipped with one ``logging``
  warning each; unknown keys raise a ValueError naming the key and the closest
  known one.
- ``null`` for a key that has a concrete default keeps the default (verl's
  "unset"), with a warning; values are coerced to the key's type (``"1e-6"``,
  which YAML reads as a string, becomes a float; a single file becomes a tuple).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from typing import Any

import yaml
from ml_collections import ConfigDict

from rlhf_jax.config import schema
from rlhf_jax.config.interpolation import InterpolationError, has_reference, resolve
from rlhf_jax.config.key import Key
from rlhf_jax.config.verl_compat import find_ignored

log = logging.getLogger("rlhf_jax.config")


def _to_tuple(value: Any) -> tuple:
    """Lists (recursively) to tuples; a scalar to a 1-tuple."""
    if isinstance(value, (list, tuple)):
        return tuple(_to_tuple(v) if isinstance(v, (list, tuple)) else v for v in value)
    return (value,)


def coerce(key: Key, value: Any) -> Any:
    """``value`` converted to the type of schema ``key``; ValueError naming the key if impossible."""
    want = key.value_type

    def fail() -> ValueError:
        return ValueError(f"{key.path}: expected {want.__name__}, got {value!r} ({type(value).__name__})")

    if want is object:  # free-form (e.g. a mapping of options)
        return value
    if want is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise fail()
    if want is int:
        if isinstance(value, bool):
            raise fail()
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise fail() from None
        raise fail()
    if want is float:
        if isinstance(value, bool):
            raise fail()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise fail() from None
        raise fail()
    if want is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise fail()
    if want is tuple:
        if isinstance(value, dict):
            raise fail()
        return _to_tuple(value)
    raise fail()


def _nested_get(mapping: dict, path: str) -> Any:
    node: Any = mapping
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(path)
        node = node[part]
    return node


def _collect(
    mapping: dict, prefix: str, source: str, out: list[tuple[str, Any]], lookup: Callable[[str], Any]
) -> None:
    """Walk the YAML mapping: schema keys into ``out``, ignored keys warned about, unknown keys rejected."""
    for name, value in mapping.items():
        path = f"{prefix}{name}"
        known = path in schema.DOCS
        if known:
            out.append((path, value))
            continue
        if schema.is_section(path):
            if isinstance(value, dict):
                _collect(value, path + ".", source, out, lookup)
                continue
            if value is None:
                continue
            raise ValueError(f"{source}: {path} is a section and needs a mapping, got {value!r}")
        ignored = find_ignored(path)
        if ignored is not None:
            if ignored.accept is not None and has_reference(value):
                try:
                    value = resolve(value, lookup, path)
                except InterpolationError:
                    value = None  # refers to a key set nowhere: verl's default, which is "off"
            if ignored.accept is not None and not ignored.accept(value):
                raise ValueError(f"{source}: {path}={value!r} is not supported by rlhf_jax ({ignored.reason})")
            log.warning("%s: ignoring verl key %s (%s)", source, path, ignored.reason)
            continue
        raise ValueError(f"{source}: {schema.unknown_key_message(path)}")


def apply_mapping(mapping: dict, base: ConfigDict | None = None, *, source: str = "<mapping>") -> ConfigDict:
    """A copy of ``base`` (default: the base schema) with the nested verl-style ``mapping`` applied."""
    if not isinstance(mapping, dict):
        raise ValueError(f"{source}: expected a mapping at the top level, got {type(mapping).__name__}")
    cfg = schema.base_config() if base is None else copy.deepcopy(base)

    def lookup(path: str) -> Any:
        try:
            return _nested_get(mapping, path)
        except KeyError:
            if path in schema.DOCS:
                return schema.get_path(cfg, path)
            raise

    entries: list[tuple[str, Any]] = []
    _collect(mapping, "", source, entries, lookup)

    for path, value in entries:
        key = schema.get_key(path)
        if has_reference(value):
            value = resolve(value, lookup, path)
        if value is None:
            if key.default is not None:
                log.warning("%s: %s is null; keeping the default %r", source, path, schema.get_path(cfg, path))
                continue
            schema.set_path(cfg, path, None)
            continue
        try:
            schema.set_path(cfg, path, coerce(key, value))
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
    return cfg


def load_yaml(path_or_text: str | os.PathLike, base: ConfigDict | None = None) -> ConfigDict:
    """Load a verl-style YAML file (or YAML text containing a newline) onto ``base`` / the base schema."""
    text_given = isinstance(path_or_text, str) and "\n" in path_or_text
    if text_given:
        source, text = "<yaml>", str(path_or_text)
    else:
        source = os.fspath(path_or_text)
        if not os.path.isfile(os.path.expanduser(source)):
            raise FileNotFoundError(f"YAML config {source} does not exist")
        with open(os.path.expanduser(source)) as fh:
            text = fh.read()
    mapping = yaml.safe_load(text)
    if mapping is None:
        mapping = {}
    return apply_mapping(mapping, base, source=source)
