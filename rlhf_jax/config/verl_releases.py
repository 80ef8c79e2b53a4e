"""Which of verl's releases name each key: read from verl's own ``ppo_trainer.yaml`` at every release tag.

The table (``verl_releases.json`` next to this file) maps a dotted key path to the releases whose trainer config
has it; ``docs/CONFIG.md`` shows it per schema key and per verl alias, so a user with an older script can see
whether a name is the one their verl used. Regenerate from a clone of verl (with its tags) after a verl release:

    python -m rlhf_jax.config.verl_releases /path/to/verl > rlhf_jax/config/verl_releases.json

From v0.5.0 on, the resolved ``_generated_ppo_trainer.yaml`` is read (the plain file composes its sections from
others through Hydra's defaults list); earlier releases kept every key in ``ppo_trainer.yaml``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

RELEASES = ("v0.1", "v0.2", "v0.3.0.post1", "v0.4.0", "v0.4.1", "v0.5.0", "v0.6.0", "v0.6.1", "v0.7.0", "v0.7.1",
            "v0.8.0", "v0.9.0")
_CONFIG_DIR = "verl/trainer/config/"
TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_releases.json")


def flat_paths(mapping: dict, prefix: str = "") -> set[str]:
    """Every dotted path of a nested mapping, sections included."""
    out = set()
    for name, value in mapping.items():
        path = f"{prefix}{name}"
        out.add(path)
        if isinstance(value, dict):
            out |= flat_paths(value, path + ".")
    return out


def _show(repo: str, tag: str, path: str) -> str | None:
    proc = subprocess.run(["git", "-C", repo, "show", f"{tag}:{path}"], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def collect(repo: str) -> dict[str, list[str]]:
    """{dotted path: [releases that name it]} from the verl clone at ``repo``."""
    import yaml

    found: dict[str, list[str]] = {}
    for tag in RELEASES:
        text = _show(repo, tag, _CONFIG_DIR + "_generated_ppo_trainer.yaml") or _show(repo, tag,
                                                                                     _CONFIG_DIR + "ppo_trainer.yaml")
        if text is None:
            raise FileNotFoundError(f"{repo}: release {tag} has no {_CONFIG_DIR}ppo_trainer.yaml (fetch verl's tags)")
        for path in flat_paths(yaml.safe_load(text) or {}):
            found.setdefault(path, []).append(tag)
    return dict(sorted(found.items()))


@functools.lru_cache(maxsize=1)
def table() -> dict[str, list[str]]:
    with open(TABLE) as f:
        return json.load(f)


def releases_of(path: str) -> str:
    """The releases naming ``path``, as ranges of consecutive releases ("v0.1-v0.9.0", "v0.5.0-v0.7.1, v0.9.0");
    "" when no release does."""
    tags = set(table().get(path, ()))
    runs: list[list[str]] = []
    previous_in = False
    for tag in RELEASES:
        if tag in tags:
            if previous_in:
                runs[-1].append(tag)
            else:
                runs.append([tag])
        previous_in = tag in tags
    return ", ".join(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rlhf_jax.config.verl_releases /path/to/verl > rlhf_jax/config/verl_releases.json",
              file=sys.stderr)
        return 2
    found: Any = collect(argv[0])
    rows = [f"{json.dumps(path)}: {json.dumps(tags)}" for path, tags in sorted(found.items())]
    sys.stdout.write("{\n" + ",\n".join(rows) + "\n}\n")  # one key per line: a release's changes diff cleanly
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
