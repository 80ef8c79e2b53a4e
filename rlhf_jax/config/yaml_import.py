"""Load a verl-style YAML file onto the schema.

- Nested sections map onto dotted schema keys (``actor_rollout_ref.actor.optim.lr``).
- ``${a.b.c}`` references are resolved against the YAML itself first, then the
  base config (so ``response_length: ${data.max_response_length}`` works).
- verl's other names of schema keys (``optim.clip_grad``, DAPO's
  ``reward_kwargs.overlong_buffer_cfg``) set those keys; keys that do not apply to
  JAX (``fsdp_config``, ``strategy``, vLLM settings, see
  :mod:`rlhf_jax.config.verl_compat`) are skipped, listed in one ``logging``
  warning; unknown keys raise a ValueError naming the key and the closest
  known one.
- ``null`` for a key that has a concrete default keeps the default (verl's
  "unset"); values are coerced to the key's type (``"1e-6"``,
  which YAML reads as a string, becomes a float; a single file becomes a tuple).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import yaml
from ml_collections import ConfigDict

from rlhf_jax.config import hydra_compose, schema
from rlhf_jax.config.names import DTYPE_SPELLINGS, DTYPES
from rlhf_jax.config.interpolation import InterpolationError, has_reference, resolve
from rlhf_jax.config.key import Key
from rlhf_jax.config.verl_compat import Alias, find_alias, find_ignored

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
            return DTYPE_SPELLINGS.get(value, value) if key.choices == DTYPES else value
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


@dataclasses.dataclass
class _Found:
    """What a YAML mapping holds, sorted by how the importer treats it."""

    keys: list[tuple[str, Any]] = dataclasses.field(default_factory=list)  # schema keys
    aliases: list[tuple[Alias, Any]] = dataclasses.field(default_factory=list)  # verl's other names
    ignored: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (path, reason)


def _collect(mapping: dict, prefix: str, source: str, found: _Found, lookup: Callable[[str], Any]) -> None:
    """Walk the YAML mapping: schema keys and aliases kept, ignored keys checked, unknown keys rejected."""
    for name, value in mapping.items():
        path = f"{prefix}{name}"
        if path in schema.DOCS:
            found.keys.append((path, value))
            continue
        if schema.is_section(path):
            if isinstance(value, dict):
                _collect(value, path + ".", source, found, lookup)
                continue
            if value is None:
                continue
            raise ValueError(f"{source}: {path} is a section and needs a mapping, got {value!r}")
        alias = find_alias(path)
        if alias is not None:
            found.aliases.append((alias, value))
            continue
        ignored = find_ignored(path)
        if ignored is not None:
            if ignored.accept is not None:
                value = _resolve_nested(value, lookup, path)
            if ignored.accept is not None and not ignored.accept(value):
                raise ValueError(f"{source}: {path}={value!r} is not supported by rlhf_jax ({ignored.reason})")
            found.ignored.append((path, ignored.reason))
            continue
        if isinstance(value, dict):  # a verl section we do not have: its keys are judged one by one
            _collect(value, path + ".", source, found, lookup)
            continue
        raise ValueError(f"{source}: {schema.unknown_key_message(path)}")


def _resolve_nested(value: Any, lookup: Callable[[str], Any], path: str) -> Any:
    """``value`` with the ``${...}`` references in it (and in its mappings and lists) resolved; a reference to a
    key set nowhere reads as None (verl's default for such keys, which is "off")."""
    if isinstance(value, dict):
        return {k: _resolve_nested(v, lookup, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_nested(v, lookup, path) for v in value]
    if not has_reference(value):
        return value
    try:
        return resolve(value, lookup, path)
    except InterpolationError:
        return None


def _warn_ignored(source: str, ignored: list[tuple[str, str]]) -> None:
    """One warning for the whole file, keys grouped by the reason they do not apply."""
    if not ignored:
        return
    by_reason: dict[str, list[str]] = {}
    for path, reason in ignored:
        by_reason.setdefault(reason, []).append(path)
    lines = "\n".join(f"  {', '.join(paths)}: {reason}" for reason, paths in by_reason.items())
    log.warning("%s: %d verl keys have no meaning in rlhf_jax and are ignored:\n%s", source, len(ignored), lines)


def apply_mapping(mapping: dict, base: ConfigDict | None = None, *, source: str = "<mapping>",
                  overrides: dict[str, Any] | None = None, warn: bool = True) -> ConfigDict:
    """A copy of ``base`` (default: the base schema) with the nested verl-style ``mapping`` applied.

    ``overrides`` ({dotted schema key: typed value}, the command line's) win over the file, and the file's
    ``${...}`` references see them, as in verl (OmegaConf resolves references after the overrides).
    """
    if not isinstance(mapping, dict):
        raise ValueError(f"{source}: expected a mapping at the top level, got {type(mapping).__name__}")
    cfg = schema.base_config() if base is None else copy.deepcopy(base)
    overrides = overrides or {}

    def lookup(path: str) -> Any:
        if path in overrides:
            return overrides[path]
        try:
            return _nested_get(mapping, path)
        except KeyError:
            if path in schema.DOCS:
                return schema.get_path(cfg, path)
            raise

    found = _Found()
    _collect(mapping, "", source, found, lookup)
    if warn:
        _warn_ignored(source, found.ignored)

    def value_of(path: str, raw: Any) -> Any:
        """The resolved, coerced value for schema key ``path``; None for verl's null."""
        if has_reference(raw):
            raw = resolve(raw, lookup, path)
        if raw is None:
            return None
        try:
            return coerce(schema.get_key(path), raw)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    # Aliases first: the schema key itself, where the file also sets it, must agree with them.
    given = dict(found.keys)
    for alias, raw in found.aliases:
        value = value_of(alias.target, raw)
        if not alias.assign or value is None or alias.target in overrides:
            continue
        if alias.target in given and given[alias.target] is not None:
            own = value_of(alias.target, given[alias.target])
            if own != value:
                raise ValueError(f"{source}: {alias.path}={value!r} and {alias.target}={own!r} set the same thing: "
                                 "give them the same value (or remove one)")
        schema.set_path(cfg, alias.target, value)
    for path, raw in found.keys:
        value = value_of(path, raw)
        if value is None:
            key = schema.get_key(path)
            if key.default is not None:
                log.info("%s: %s is null; keeping %r", source, path, schema.get_path(cfg, path))
                continue
        schema.set_path(cfg, path, value)
    for path, value in overrides.items():
        schema.set_path(cfg, path, value)
    for alias, raw in found.aliases:  # copies of a key verl keeps in two places must agree with it
        value = value_of(alias.target, raw)
        if alias.assign or value is None or alias.target in overrides:  # the command line decides for every copy
            continue
        target = alias.target
        if schema.get_path(cfg, target) is None and alias.fallback:
            target = alias.fallback
        if value != schema.get_path(cfg, target):
            raise ValueError(f"{source}: {alias.path}={value!r} differs from {target}="
                             f"{schema.get_path(cfg, target)!r}, which rlhf_jax uses: make them equal")
    return cfg


def load_yaml(path_or_text: str | os.PathLike, base: ConfigDict | None = None, *,
              overrides: dict[str, Any] | None = None, warn: bool = True, fmt: str | None = None) -> ConfigDict:
    """Load a YAML file (or YAML text containing a newline) onto ``base`` / the base schema.

    ``fmt`` names the file's format (verl, roll); None = recognised by its top-level keys
    (:mod:`rlhf_jax.config.dialects`). Another format's keys are translated to schema keys first.
    """
    from rlhf_jax.config import dialects

    mapping, source = read_yaml(path_or_text)
    fmt = fmt or dialects.detect(mapping)
    if fmt in dialects.COMPOSED and hydra_compose.has_defaults(mapping):  # ROLL's files are Hydra primary configs
        if source == "<yaml>":
            raise ValueError("<yaml>: a defaults list names files relative to its own file: load it from a file")
        mapping = hydra_compose.compose(mapping, os.path.expanduser(source))
    if fmt != "verl":
        mapping = dialects.nested(dialects.to_schema(mapping, fmt, source, warn=warn))
    return apply_mapping(mapping, base, source=source, overrides=overrides, warn=warn)


def read_yaml(path_or_text: str | os.PathLike) -> tuple[dict, str]:
    """(the parsed mapping, its source name) of a YAML file or YAML text containing a newline."""
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
    return ({} if mapping is None else mapping), source
