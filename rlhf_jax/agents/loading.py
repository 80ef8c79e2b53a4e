"""``path/to/file.py:name`` -> the object the user's file defines under that name (environments, workflows).

Faults are one-line ``ValueError``s naming the config key: a missing file, an import that fails (with the
exception), a name the file does not define. A file is imported once per process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import Any


def load_from_file(spec: str, key: str) -> Any:
    path, name = spec.rsplit(":", 1)
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ValueError(f"{key}: file not found: {path}")
    module_name = "rlhf_jax_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file: one line, not a traceback
            raise ValueError(f"{key}: importing {path} failed: {type(e).__name__}: {e}") from None
        sys.modules[module_name] = module
    if not hasattr(module, name):
        raise ValueError(f"{key}: {path} defines no {name!r}")
    return getattr(module, name)
