"""``path/to/file.py:name`` -> the object the user's file defines under that name (environments, workflows).

Faults are one-line ``ValueError``s naming the config key: a missing file, an import that fails (file, line and
exception), a name the file does not define. A file is imported once per process (``rewards.custom.import_user_file``,
shared with custom reward functions).
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.rewards.custom import import_user_file


def load_from_file(spec: str, key: str) -> Any:
    path, name = spec.rsplit(":", 1)
    path, module = import_user_file(path, key, error=ValueError, missing=ValueError)
    if not hasattr(module, name):
        raise ValueError(f"{key}: {path} defines no {name!r}")
    return getattr(module, name)
