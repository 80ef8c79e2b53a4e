"""``path/to/file.py:name`` -> the object the user's file defines under that name (environments, workflows); a
user's YAML file (verl's tool and interaction files) -> its contents.

Faults are one-line ``ValueError``s naming the config key: a missing file, an import that fails (file, line and
exception), a name the file does not define. A file is imported once per process (``rewards.custom.import_user_file``,
shared with custom reward functions).
"""

from __future__ import annotations

import os
from typing import Any

from rlhf_jax.rewards.custom import import_user_file


def load_from_file(spec: str, key: str) -> Any:
    path, name = spec.rsplit(":", 1)
    path, module = import_user_file(path, key, error=ValueError, missing=ValueError)
    if not hasattr(module, name):
        raise ValueError(f"{key}: {path} defines no {name!r}")
    return getattr(module, name)


def read_yaml_file(path: str, where: str) -> Any:
    """The parsed YAML file at ``path`` (``{}`` when empty); a missing file or bad YAML is one line naming ``where``."""
    import yaml

    full = os.path.expanduser(path)
    if not os.path.isfile(full):
        raise ValueError(f"{where}: no such file")
    try:
        with open(full) as f:
            return yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
