"""Other trainers' config files, read onto the schema: one module per format, each a table of rules.

:func:`detect` names a file's format from its top-level keys; :func:`to_schema` turns a file of another
format into ``{schema key: value}`` (with that trainer's defaults for the keys it omits, so the run means
what the file meant there), logging the keys with no meaning here in one warning and refusing, by name,
the ones whose value would change what a run does. verl files need no translation: their keys are ours.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rlhf_jax.config.dialects import atorch, roll, roll_agentic, roll_dpo, trainer_config, trinity, verl_sft
from rlhf_jax.config.dialects.rules import translate
from rlhf_jax.config.names import ENV_RESTART_MARK

log = logging.getLogger("rlhf_jax.config")

FORMATS = ("verl", "roll", "trinity", "trainer_config", "atorch", "verl_sft")
# Formats whose files are Hydra primary configs: their defaults lists are composed before translation.
COMPOSED = ("roll",)
_MODULES = {"roll": roll, "trinity": trinity, "trainer_config": trainer_config, "atorch": atorch,
            "verl_sft": verl_sft}
MODULES = _MODULES  # every format but verl's own, by name: its module holds RULES, DEFAULTS and finish
TABLES = {**_MODULES, "roll_dpo": roll_dpo, "roll_agentic": roll_agentic}  # every rule table (ROLL's DPO and agentic files have their own)


def detect(mapping: dict) -> str:
    """The format of a parsed config file: roll, trinity, trainer_config, atorch, verl_sft (verl's sft_trainer.yaml),
    else verl."""
    keys = set(mapping)
    if keys & set(roll.MARKERS):
        return "roll"
    if keys & set(trinity.MARKERS) or isinstance(mapping.get("model"), dict) and "model_path" in mapping["model"]:
        return "trinity"
    if keys & set(trainer_config.MARKERS):
        return "trainer_config"
    if keys & set(atorch.MARKERS) or atorch.looks_like(mapping):
        return "atorch"
    if verl_sft.is_sft_file(mapping):
        return "verl_sft"
    return "verl"


def to_schema(mapping: dict, fmt: str, source: str, *, warn: bool = True) -> dict[str, Any]:
    """``{schema key: value}`` for a ``fmt`` file; ValueError naming the first key that cannot be honoured."""
    if fmt not in _MODULES:
        raise ValueError(f"--config_format={fmt!r} is not one of {', '.join(FORMATS)}")
    module = _MODULES[fmt]
    if fmt == "roll" and roll_dpo.is_dpo(mapping):  # ROLL's DPO pipeline: a table of its own
        module = roll_dpo
    elif fmt == "roll" and roll_agentic.is_agentic(mapping):  # ROLL's agentic pipeline: environments
        module = roll_agentic
    values, ignored = translate(mapping, module.RULES, module.DEFAULTS, fmt, source, module.finish)
    # a command restarted to apply trainer.env_vars reads its file again: the first process warned already
    if warn and ignored and os.environ.get(ENV_RESTART_MARK) != "1":
        by_reason: dict[str, list[str]] = {}
        for path, reason in ignored:
            by_reason.setdefault(reason, []).append(path)
        lines = "\n".join(f"  {', '.join(paths)}: {reason}" for reason, paths in by_reason.items())
        log.warning("%s: %d %s keys have no meaning in rlhf_jax and are ignored:\n%s", source, len(ignored), fmt,
                    lines)
    return values


def nested(flat: dict[str, Any]) -> dict:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}`` (a verl-style mapping of schema keys)."""
    out: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
