"""``${a.b.c}`` references inside string values, as in verl's OmegaConf YAML files.

A value that is exactly one reference takes the referenced value with its type
(``response_length: ${data.max_response_length}`` gives an int); references
inside a longer string are substituted as text
(``checkpoints/${trainer.project_name}/${trainer.experiment_name}``).
``${oc.env:NAME}`` and ``${oc.env:NAME,default}`` read environment variables;
``${oc.select:a.b.c,default}`` is a key reference with a fallback for a key set nowhere;
``${.x}`` / ``${..x}`` refer to ``x`` in the key's own section / the one above it.
References may chain; a cycle is an error naming the keys involved.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import yaml

_REF = re.compile(r"\$\{([^${}]+)\}")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class InterpolationError(ValueError):
    """A ``${...}`` reference that cannot be resolved."""


def has_reference(value: Any) -> bool:
    """True if ``value`` is a string holding at least one ``${...}``."""
    return isinstance(value, str) and "${" in value


def _env(arg: str, key: str) -> str:
    name, sep, default = arg.partition(",")
    name = name.strip()
    if name in os.environ:
        return os.environ[name]
    if sep:
        return default.strip().strip("'\"")
    raise InterpolationError(f"{key}: environment variable {name!r} (from ${{oc.env:{arg}}}) is not set")


def resolve(
    value: Any,
    lookup: Callable[[str], Any],
    key: str,
    _stack: tuple[str, ...] = (),
) -> Any:
    """Resolve every ``${...}`` in ``value`` (the value of config key ``key``).

    ``lookup(path)`` returns the raw (possibly itself referencing) value at a
    dotted path, or raises KeyError if there is none.
    """
    if not has_reference(value):
        return value
    if key in _stack:
        raise InterpolationError(f"circular ${{...}} reference: {' -> '.join(_stack + (key,))}")
    stack = _stack + (key,)

    def one(expr: str) -> Any:
        expr = expr.strip()
        if expr.startswith("oc.env:"):
            return _env(expr[len("oc.env:"):], key)
        if expr.startswith("oc.select:"):
            path, sep, default = expr[len("oc.select:"):].partition(",")
            try:
                target = lookup(path.strip())
            except KeyError:
                if not sep:
                    return None  # OmegaConf's oc.select without a default gives null
                return yaml.safe_load(default.strip()) if default.strip() else None
            return resolve(target, lookup, path.strip(), stack)
        if expr.startswith("."):  # OmegaConf's relative reference: "." = the key's own section, each further "." one up
            dots = len(expr) - len(expr.lstrip("."))
            section = key.split(".")[:-dots]
            expr = ".".join(section + [expr[dots:]]) if expr[dots:] else ""
        if not _KEY.match(expr):
            raise InterpolationError(
                f"{key}: unsupported reference ${{{expr}}}; only ${{a.b.c}} key references and ${{oc.env:NAME}} "
                "are resolved"
            )
        try:
            target = lookup(expr)
        except KeyError:
            raise InterpolationError(f"{key}: ${{{expr}}} refers to a key that does not exist") from None
        return resolve(target, lookup, expr, stack)

    whole = _REF.fullmatch(value.strip())
    if whole:
        return one(whole.group(1))
    out = _REF.sub(lambda m: str(one(m.group(1))), value)
    if "${" in out:
        raise InterpolationError(f"{key}: could not resolve {value!r} (nested or malformed ${{...}})")
    return out
