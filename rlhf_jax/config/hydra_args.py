"""verl's command line: the Hydra-style arguments of ``python3 -m verl.trainer.main_ppo``.

``key=value`` sets a key, ``+key=value`` adds one (here: sets it, since the schema already holds every key rlhf_jax
honours) and ``++key=value`` too, ``~key`` (or ``~key=value``) removes it (the key goes back to its default).
Values are read as Hydra reads them: YAML flow syntax (``'["console","wandb"]'``, ``"['a', 'b']"``, ``null``,
``true`` / ``True``, numbers), anything else as text (so ``key=a=b`` is the text ``a=b``). Later arguments win over
earlier ones. The result, nested (``dialects.nested``), is applied like a verl YAML file: verl's moved key names,
the one warning for keys with no meaning in one JAX program and the closest-key error for a typo all come from
``yaml_import``. Hydra's ``--config-path DIR --config-name NAME`` (``-cp`` / ``-cn``) name the primary file,
``DIR/NAME.yaml`` (``config_file``), whose defaults list composes verl's ``ppo_trainer`` as verl's files do.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import yaml

_KEY = re.compile(r"^[A-Za-z_][\w\-]*(\.[A-Za-z_0-9][\w\-]*)*$")
REMOVED = object()  # the value of a ``~key``: back to the default


def is_hydra_arg(arg: str) -> bool:
    """Whether ``arg`` is a verl/Hydra override (``key=value``, ``+key=value``, ``~key``), not a ``--flag``."""
    return not arg.startswith("-") and ("=" in arg or arg.startswith("~"))


def parse_value(raw: str, arg: str) -> Any:
    """``raw`` as Hydra reads a value; a malformed list or mapping is an error naming ``arg``."""
    if raw == "":
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        if raw.lstrip()[:1] in "[{":
            raise ValueError(f"{arg}: cannot read {raw!r} as a list or mapping (Hydra's syntax: "
                             "key='[a, b]' or key=\"['a', 'b']\")") from None
        return raw
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, str):
        try:  # YAML 1.1 reads 1e-6 as text; Hydra reads it as a number
            return float(value) if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", value) else value
        except ValueError:
            return value
    return value


def parse(args: Sequence[str]) -> dict[str, Any]:
    """{dotted key: value or REMOVED} of Hydra-style ``args``, in order, later ones winning."""
    out: dict[str, Any] = {}
    for arg in args:
        body = arg.lstrip("+")
        removing = body.startswith("~")
        body = body.lstrip("~")
        key, _, raw = body.partition("=")
        if not _KEY.match(key):
            raise ValueError(f"{arg}: expected key=value, +key=value or ~key with a dotted key")
        out.pop(key, None)  # a later argument replaces an earlier one (and takes its place in the order)
        out[key] = REMOVED if removing else parse_value(raw, arg)
    return out


_FILE_FLAGS = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name", "--config-dir": "dir",
               "-cd": "dir"}


def config_file(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """``argv`` without Hydra's ``--config-path`` / ``--config-name`` (``=value`` or a separate value) and the
    file they name, ``path/name.yaml`` (None when neither is given). verl's own ``--config-name=ppo_trainer`` with no
    path is verl's defaults (None too)."""
    found: dict[str, str] = {}
    rest, i = [], 0
    argv = list(argv)
    while i < len(argv):
        flag, sep, value = argv[i].partition("=")
        if flag in _FILE_FLAGS:
            if not sep and i + 1 >= len(argv):
                raise ValueError(f"{flag} needs a value")
            value, i = (value, i + 1) if sep else (argv[i + 1], i + 2)
            found[_FILE_FLAGS[flag]] = value
            continue
        rest.append(argv[i])
        i += 1
    if "dir" in found:
        raise ValueError(f"--config-dir={found['dir']}: name the file with --config-path and --config-name")
    if not found:
        return rest, None
    name = found.get("name")
    if not name:
        raise ValueError(f"--config-path={found['path']} needs --config-name (the file's name in that folder)")
    if "path" not in found:
        if name.removesuffix(".yaml") == "ppo_trainer":
            return rest, None
        raise ValueError(f"--config-name={name} without --config-path names a file of verl's own checkout; give "
                         "--config-path (the folder that holds it)")
    file = os.path.join(os.path.expanduser(found["path"]), name if name.endswith((".yaml", ".yml")) else name + ".yaml")
    if not os.path.isfile(file):
        raise ValueError(f"--config-path={found['path']} --config-name={name}: no such file {file}")
    return rest, file
