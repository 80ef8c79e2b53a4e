"""Hydra's ``defaults:`` list: the files a config is composed from, merged as Hydra merges them.

ROLL's example files are Hydra primary configs that pull shared parts from other files
(``defaults: [../config/traj_envs@_here_, _self_]``). Composition here follows Hydra 1.1+:

- an entry names a file relative to the directory of the file that lists it (``../config/traj_envs``), or, with a
  leading ``/``, relative to the primary file's directory; ``{group: option}`` names ``group/option.yaml`` and
  ``{group: [a, b]}`` several options of one group; ``{optional group: option}`` is skipped when the file is absent;
  ``{override group: option}`` changes the option another defaults list (a nested one) picks for ``group``;
  an option ``null`` adds nothing;
- ``@package`` places the file's content: ``_here_`` at the package of the listing file, ``_global_`` at the root,
  ``a.b`` under ``a.b`` of the listing file's package (``_global_.a.b`` from the root). Without it a group entry's
  content goes under the group's name and a plain file's under its directory path;
- ``_self_`` is where the listing file's own keys are merged (default: last, so the file overrides what it
  composes); mappings merge key by key, any other value is replaced, later entries win;
- files listed by a composed file are composed the same way, relative to that file.

``${...}`` references are not resolved here: they are resolved on the composed whole, so a composed part may refer
to keys of the primary file and the primary file's values win (``max_tokens_per_step: 64`` changes
``${max_tokens_per_step}`` everywhere), as in Hydra.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import yaml

SELF = "_self_"


def has_defaults(mapping: Any) -> bool:
    return isinstance(mapping, dict) and isinstance(mapping.get("defaults"), list)


def compose(mapping: dict, path: str) -> dict:
    """The file at ``path`` (already parsed as ``mapping``) with its defaults list composed; the list is removed."""
    primary_dir = os.path.dirname(os.path.abspath(path))
    overrides = _overrides(mapping, path)
    return _compose(mapping, os.path.abspath(path), "", primary_dir, overrides, (os.path.abspath(path),))


def _overrides(mapping: dict, source: str) -> dict[str, Any]:
    """``{group: option}`` of the primary file's ``override group: option`` entries."""
    out = {}
    for entry in mapping.get("defaults") or []:
        if isinstance(entry, dict) and len(entry) == 1:
            (key, value), = entry.items()
            if str(key).startswith("override "):
                group = str(key)[len("override "):].strip().split("@")[0]
                out[group] = value
    return out


def _split_package(text: str) -> tuple[str, str | None]:
    name, sep, package = text.partition("@")
    return name.strip(), (package.strip() if sep else None)


def _package(parent: str, package: str | None, default: str) -> str:
    """The dotted place of an entry's content, given the listing file's package ``parent``."""
    if package is None:
        package = default
    if package == "_here_":
        return parent
    if package == "_global_":
        return ""
    if package.startswith("_global_."):
        return package[len("_global_."):]
    return f"{parent}.{package}" if parent and package else (parent or package)


def _file(base_dir: str, primary_dir: str, name: str) -> str:
    root = primary_dir if name.startswith("/") else base_dir
    target = os.path.normpath(os.path.join(root, name.lstrip("/")))
    return target if target.endswith((".yaml", ".yml")) else target + ".yaml"


def _entries(mapping: dict, source: str, base_dir: str, primary_dir: str, overrides: dict[str, Any]):
    """(file path or SELF, package relative to the listing file, optional) for each entry, in order."""
    defaults = mapping.get("defaults")
    out = []
    for entry in defaults:
        if entry == SELF:
            out.append((SELF, None, False))
        elif isinstance(entry, str):
            name, package = _split_package(entry)
            directory = os.path.dirname(name.lstrip("/"))
            if package is None and ".." in directory.split("/"):
                raise ValueError(f"{source}: defaults entry {entry!r} goes above its directory and says no package; "
                                 "add @_here_ (or @<key>) to say where its keys go")
            out.append((_file(base_dir, primary_dir, name), package if package is not None else
                        directory.replace("/", "."), False))
        elif isinstance(entry, dict) and len(entry) == 1:
            (key, option), = entry.items()
            key = str(key)
            optional = key.startswith("optional ")
            if key.startswith("override "):
                continue  # applied where the group is listed
            group, package = _split_package(key.removeprefix("optional ").strip())
            option = overrides.get(group, option)
            options = option if isinstance(option, list) else [option]
            for one in options:
                if one is None:
                    continue
                out.append((_file(base_dir, primary_dir, f"{group}/{one}"),
                            package if package is not None else group.strip("/").replace("/", "."), optional))
        else:
            raise ValueError(f"{source}: defaults entry {entry!r} is not a file name, _self_ or {{group: option}}")
    if SELF not in [e[0] for e in out]:
        out.append((SELF, None, False))  # Hydra 1.1: the listing file's own keys come last
    return out


def _compose(mapping: dict, source: str, package: str, primary_dir: str, overrides: dict[str, Any],
             chain: tuple[str, ...]) -> dict:
    """The content of one file, composed, placed at ``package``."""
    if not has_defaults(mapping):
        if isinstance(mapping, dict) and "defaults" in mapping and mapping["defaults"] is not None:
            raise ValueError(f"{source}: defaults must be a list, got {mapping['defaults']!r}")
        own = {k: v for k, v in (mapping or {}).items() if k != "defaults"}
        return _place(own, package)
    base_dir = os.path.dirname(source)
    out: dict = {}
    for target, rel_package, optional in _entries(mapping, source, base_dir, primary_dir, overrides):
        if target == SELF:
            part = _place({k: v for k, v in mapping.items() if k != "defaults"}, package)
        else:
            if not os.path.isfile(target):
                if optional:
                    continue
                raise FileNotFoundError(f"{source}: defaults entry names {target}, which does not exist")
            if target in chain:
                raise ValueError(f"{source}: defaults entries include each other: {' -> '.join(chain + (target,))}")
            with open(target) as fh:
                loaded = yaml.safe_load(fh) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{target}: expected a mapping at the top level, got {type(loaded).__name__}")
            part = _compose(loaded, target, _package(package, rel_package, ""), primary_dir, overrides,
                            chain + (target,))
        merge_into(out, part)
    return out


def _place(content: dict, package: str) -> dict:
    for part in reversed([p for p in package.split(".") if p]):
        content = {part: content}
    return content


def merge_into(base: dict, other: dict) -> None:
    """Merge ``other`` into ``base``: mappings key by key, everything else replaced (OmegaConf's merge)."""
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge_into(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
