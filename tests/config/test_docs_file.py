"""docs/CONFIG.md is the generated reference of the current schema (regenerate with `python -m rlhf_jax.config docs`)."""

import os

from rlhf_jax.config import render_markdown

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_config_reference_is_up_to_date():
    with open(os.path.join(REPO, "docs", "CONFIG.md")) as f:
        on_disk = f.read()
    assert on_disk.strip() == render_markdown().strip(), (
        "docs/CONFIG.md is stale: run `python -m rlhf_jax.config docs > docs/CONFIG.md`"
    )
