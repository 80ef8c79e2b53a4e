"""What the command-line tools print: our progress, warnings and errors, not the banners of the libraries they
load for one part only.

Called first thing by each tool's ``main``, before those libraries are imported (they read their switches
then). A user's own setting of any of these variables wins.
"""

from __future__ import annotations

import logging
import os

QUIET_ENV = {
    # transformers is loaded for its tokenizers and configuration files only; without PyTorch installed it
    # would announce at import that "PyTorch was not found. Models won't be available ...".
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def configure() -> None:
    """Log level from ``RLHF_JAX_LOG_LEVEL`` (default WARNING: libraries' INFO chatter stays out) and the
    library switches above."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    logging.basicConfig(level=os.environ.get("RLHF_JAX_LOG_LEVEL", "WARNING"),
                        format="%(levelname)s %(name)s: %(message)s")
