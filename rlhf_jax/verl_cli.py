"""Command lines in the shape of verl's tools (``key=value`` Hydra overrides, an optional YAML file).

``python -m rlhf_jax.generate`` and ``python -m rlhf_jax.evaluate`` take verl's
``generation.yaml`` / ``evaluation.yaml`` keys (``data.path=...``, ``model.path=...``)
and any schema key (``data.prompt_template=raw``, ``trainer.seed=1``). verl keys that
have no meaning here (node counts, vLLM and Ray settings) are listed in one warning;
anything else is an error naming the key.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Sequence
from typing import Any

import yaml

from rlhf_jax.config import schema
from rlhf_jax.config.yaml_import import coerce

log = logging.getLogger("rlhf_jax.config")


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v and f"{prefix}{k}" not in schema.DOCS:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_args(argv: Sequence[str]) -> dict[str, Any]:
    """{dotted key: value} from ``--config=file.yaml`` (flattened) and ``key=value`` / ``+key=value`` arguments."""
    settings: dict[str, Any] = {}
    for arg in argv:
        if arg.startswith("--config="):
            with open(os.path.expanduser(arg.split("=", 1)[1])) as f:
                settings.update(_flatten(yaml.safe_load(f) or {}))
        elif "=" in arg and not arg.startswith("-"):
            key, value = arg.lstrip("+").split("=", 1)
            settings[key] = yaml.safe_load(value) if value else None
        else:
            raise ValueError(f"unexpected argument {arg!r}: give key=value overrides (verl's) or --config=file.yaml")
    return settings


def apply(settings: dict[str, Any], mapping: dict[str, str], ignored: Sequence[str], own: dict[str, Any],
          source: str) -> tuple[Any, dict[str, Any]]:
    """(schema config, the tool's own settings) from ``settings``.

    ``mapping``: the tool's verl key -> schema key; ``ignored``: fnmatch patterns of verl keys with no
    meaning here; ``own``: the tool's own keys (not in the schema) with their defaults.
    """
    cfg = schema.base_config()
    own = dict(own)
    skipped = []
    for key, value in settings.items():
        target = mapping.get(key, key if key in schema.DOCS else None)
        if key in own:
            own[key] = value
        elif target is not None:
            if value is None and schema.get_key(target).default is not None:
                continue  # verl's null: keep the default
            try:
                schema.set_path(cfg, target, None if value is None else coerce(schema.get_key(target), value))
            except ValueError as e:
                raise ValueError(f"{source}: {key}: {e}") from None
        elif any(fnmatch.fnmatchcase(key, p) for p in ignored):
            skipped.append(key)
        else:
            raise ValueError(f"{source}: unknown key {key!r}; keys: {', '.join(sorted([*mapping, *own]))} "
                             "or any rlhf_jax config key (python -m rlhf_jax.config)")
    if skipped:
        log.warning("%s: ignoring verl keys with no meaning in rlhf_jax: %s", source, ", ".join(skipped))
    return cfg, own
