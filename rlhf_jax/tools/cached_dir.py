"""Build a directory once, atomically: the shared cache discipline of the tiny and SmolLM2 models."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable


def build_once(out_dir: str, write: Callable[[str], None], marker: str) -> tuple[str, bool]:
    """Ensure ``out_dir`` holds a complete build; returns (absolute path, whether it was built now).

    ``write(staging_dir)`` fills a temporary sibling directory and must create the ``marker``
    file last; the staging directory is renamed into place only when complete, so an
    interrupted build never leaves a directory that looks finished. A leftover without
    the marker is replaced; if another process finishes first, its directory is kept.
    """
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    if os.path.exists(os.path.join(out_dir, marker)):
        return out_dir, False
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}-", dir=parent)
    try:
        write(staging)
        if not os.path.exists(os.path.join(staging, marker)):
            raise RuntimeError(f"building {out_dir}: the writer did not create the completion marker {marker}")
        if os.path.isdir(out_dir) and not os.path.exists(os.path.join(out_dir, marker)):
            shutil.rmtree(out_dir)  # a leftover without the marker is incomplete
        try:
            os.rename(staging, out_dir)
        except OSError:
            if not os.path.exists(os.path.join(out_dir, marker)):
                raise
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging)
    return out_dir, True
