"""The rule table a dialect is written in, and the walk that applies it to a parsed file."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from typing import Any

from rlhf_jax import algos
from rlhf_jax.config.interpolation import InterpolationError, has_reference, resolve


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one of their keys (an fnmatch pattern over the dotted path) becomes.

    ``to``: a schema key that takes the value (``convert``-ed), or None. ``convert(value, file)`` may also
    return a dict ``{schema key: value}`` (several keys, or none). Without ``to`` and ``convert`` the key is
    ignored with ``reason``, provided ``accept(value)`` (None: any value); otherwise it is refused by name.
    ``used_by`` (no warning, no effect of its own) marks a key another rule reads from the file.
    """

    their: str
    to: str | None = None
    convert: Callable[[Any, dict], Any] | None = None
    reason: str = ""
    accept: Callable[[Any], bool] | None = None
    used_by: str | None = None

    @property
    def maps(self) -> bool:
        return self.to is not None or self.convert is not None


def get(mapping: dict, path: str, default: Any = None) -> Any:
    """The value at dotted ``path`` of a nested mapping, or ``default``."""
    node: Any = mapping
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _set(mapping: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = mapping
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


def _resolved(mapping: dict) -> dict:
    """The file with its own ``${a.b}`` references resolved (their Hydra/OmegaConf files refer to their keys)."""
    def lookup(path: str) -> Any:
        value = get(mapping, path, KeyError)
        if value is KeyError:
            raise KeyError(path)
        return walk(value, path)

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, path) for v in value]
        if has_reference(value):
            try:
                return resolve(value, lookup, path)
            except InterpolationError as e:  # an unset environment variable, a key set nowhere
                raise ValueError(str(e)) from None
        return value

    return walk(mapping, "")


def _leaves(mapping: dict, prefix: str = ""):
    """(path, value, is_section) depth-first; an empty mapping holds nothing and is skipped."""
    for name, value in mapping.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            if value:
                yield path, value, True
                yield from _leaves(value, path + ".")
        else:
            yield path, value, False


def _rule_for(rules: tuple[Rule, ...], path: str, section: bool) -> Rule | None:
    """The rule of ``path``: an exact one, else (for a value, not a section) the first matching pattern."""
    for rule in rules:
        if rule.their == path:
            return rule
    if section:
        return None
    for rule in rules:
        if fnmatch.fnmatchcase(path, rule.their):
            return rule
    return None


def translate(mapping: dict, rules: tuple[Rule, ...], defaults: dict[str, Any], fmt: str, source: str,
              finish: Callable[[dict, dict], None] | None = None) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """(``{schema key: value}``, ignored (path, reason)) of a ``fmt`` file, with ``defaults`` for keys it omits."""
    full = _resolved(mapping)
    filled = {path for path in defaults if get(full, path, KeyError) is KeyError}
    for path in filled:
        _set(full, path, defaults[path])
    values: dict[str, Any] = {}
    ignored: list[tuple[str, str]] = []
    skip: tuple[str, ...] = ()
    for path, value, is_section in _leaves(full):
        if skip and path.startswith(skip):
            continue
        rule = _rule_for(rules, path, is_section)
        if rule is None:
            if is_section:
                continue  # its keys are judged one by one
            raise ValueError(f"{source}: {path} ({fmt} key) has no rlhf_jax equivalent; remove it, or set the "
                             "matching rlhf_jax key (docs/CONFIG.md)")
        if is_section:
            skip = (path + ".",)  # a rule for a whole section decides for its keys
        if rule.used_by is not None:
            continue
        if rule.maps:
            try:
                out = rule.convert(value, full) if rule.convert else value
            except (TypeError, ValueError) as e:
                raise ValueError(f"{source}: {e}" if str(e).startswith(path) else f"{source}: {path}={value!r}: {e}") \
                    from None
            if rule.to is not None:
                out = {rule.to: out}
            for key, v in out.items():
                if key in values and values[key] != v:
                    raise ValueError(f"{source}: {path} sets {key}={v!r}, but another {fmt} key set it to "
                                     f"{values[key]!r}; make them agree")
                values[key] = v
            continue
        if rule.accept is not None and not rule.accept(value):
            raise ValueError(f"{source}: {path}={value!r} is not supported by rlhf_jax ({rule.reason})")
        if path not in filled:  # a default we filled in is nothing the user wrote
            ignored.append((path, rule.reason))
    if finish is not None:
        finish(full, values)
    return values, ignored


def needs_critic(estimator: Any) -> bool:
    """Whether our estimator ``estimator`` trains a value model (False for a name no estimator has)."""
    return estimator in algos.ADV_ESTIMATORS and algos.estimator_info(estimator).needs_critic
