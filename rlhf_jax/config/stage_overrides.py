"""Command-line overrides and ``stages``: which value a stage trains with.

A stage's own settings beat the shared config it starts from (``train/stages.py``). So a command-line override of a
key that a stage also sets would be silently lost in that stage: it is refused instead, naming the stages that set
the key and the per-stage form that reaches them, ``--config.stages.<i>.<key>=<value>`` (``<i>`` the stage's
position from 0, or its ``stage_name``). An override of a key no stage sets reaches every stage through the shared
config, as without stages.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

from ml_collections import ConfigDict

from rlhf_jax.config import schema
from rlhf_jax.config.yaml_import import coerce

NAME = "stage_name"


def flatten_stage(mapping: dict, where: str, prefix: str = "") -> dict[str, Any]:
    """A stage's overrides as dotted schema keys: ``{"algorithm": {"type": "sft"}, "data.train_files": [...]}`` ->
    ``{"algorithm.type": "sft", "data.train_files": [...]}``; an unknown key is an error naming ``where``."""
    out: dict[str, Any] = {}
    for name, value in mapping.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict) and path not in schema.DOCS:
            if not schema.is_section(path):
                raise ValueError(f"{where}.{path}: {schema.unknown_key_message(path)}")
            out.update(flatten_stage(value, where, path + "."))
            continue
        if path not in schema.DOCS:
            raise ValueError(f"{where}.{path}: {schema.unknown_key_message(path)}")
        out[path] = value
    return out


def split_stage_args(argv: Sequence[str], name: str = "config") -> tuple[list[str], list[tuple[str, str, str]]]:
    """``argv`` without its ``--<name>.stages.<i>.<key>=<value>`` arguments, and those as (argument as written up to
    the value, stage selector ``<i>``, key, raw value) tuples."""
    rest, found = [], []
    args = list(argv)
    k = 0
    while k < len(args):
        arg = args[k]
        prefix = next((p for p in (f"--{name}.stages.", f"-{name}.stages.") if arg.startswith(p)), None)
        if prefix is None:
            rest.append(arg)
            k += 1
            continue
        body = arg[len(prefix):]
        if "=" in body:
            target, value = body.split("=", 1)
        elif k + 1 < len(args):
            target, value = body, args[k + 1]
            k += 1
        else:
            raise ValueError(f"{arg}: expected {prefix}<i>.<key>=<value>")
        selector, _, path = target.partition(".")
        if not selector or not path:
            raise ValueError(f"{arg}: expected {prefix}<i>.<key>=<value> (<i>: the stage's position from 0 or its "
                             f"{NAME})")
        if path not in schema.DOCS:
            raise ValueError(f"{prefix}{target}: {schema.unknown_key_message(path)}")
        found.append((f"{prefix}{target}", selector, path, value))
        k += 1
    return rest, found


def _without_name(stage) -> dict:
    return {k: v for k, v in dict(stage).items() if k != NAME}


def _stage_index(stages: tuple, selector: str, arg: str) -> int:
    names = [str(dict(s).get(NAME, f"stage{i}")) for i, s in enumerate(stages)]
    if selector.isdigit() and int(selector) < len(stages):
        return int(selector)
    if selector in names:
        return names.index(selector)
    listed = ", ".join(f"{i} ({n})" for i, n in enumerate(names)) or "none"
    raise ValueError(f"{arg}: no stage {selector!r}; the config's stages are: {listed}")


def _parse(raw: str) -> Any:
    """A command-line value as Python would read it (``3``, ``1e-5``, ``('a','b')``, ``True``), else the text."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def apply_stage_overrides(cfg: ConfigDict, plain: dict[str, str], stage_args: list, name: str = "config") -> None:
    """Refuse a plain override of a key some stage sets; write each per-stage override into its stage (in
    place; ``cfg`` may be locked, since ``stages`` already exists)."""
    stages = tuple(cfg.stages or ())
    if stage_args and not stages:
        raise ValueError(f"{stage_args[0][0]}: this config has no stages; override the key as --{name}.<key>=<value>")
    flat = [flatten_stage(_without_name(s), f"stages[{i}]") for i, s in enumerate(stages)]
    for path, raw in plain.items():
        setters = [i for i, keys in enumerate(flat) if path in keys]
        if setters:
            who = " and ".join(f"stages[{i}] ({dict(stages[i]).get(NAME, f'stage{i}')})" for i in setters)
            forms = " ".join(f"--{name}.stages.{i}.{path}={raw}" for i in setters)
            raise ValueError(f"--{name}.{path}: {who} {'sets' if len(setters) == 1 else 'set'} {path} "
                             f"{'itself' if len(setters) == 1 else 'themselves'}, which "
                             f"would win over this override; set it per stage: {forms}")
    if not stage_args:
        return
    new = [dict(s) for s in stages]
    for arg, selector, path, raw in stage_args:
        i = _stage_index(stages, selector, arg)
        try:
            value = coerce(schema.get_key(path), _parse(raw))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{arg}: {e}") from None
        # the stage's own mapping keeps its nesting; the dotted key replaces any nested setting of the same key
        stage = {NAME: new[i].get(NAME, f"stage{i}"), **{k: v for k, v in flat[i].items() if k != path}}
        stage[path] = value
        new[i], flat[i] = stage, {k: v for k, v in stage.items() if k != NAME}
    cfg.stages = tuple(new)
