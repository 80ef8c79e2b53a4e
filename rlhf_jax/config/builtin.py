"""``builtin:<name>`` paths: the tiny model and synthetic data sets that need no download.

``actor_rollout_ref.model.path = "builtin:tiny"`` names the small random Llama
of :mod:`rlhf_jax.tools.tiny`; ``"builtin:smollm2"`` the real SmolLM2-135M-Instruct,
converted on first use by :mod:`rlhf_jax.tools.smollm2` (needs the ``smollm2`` extra); ``data.train_files = ("builtin:arithmetic",)``
names a synthetic data set generated on first use by :mod:`rlhf_jax.data`.
Checking these names never builds anything; :func:`resolve_model_path`
builds the model (once, cached) and returns its directory.
"""

from __future__ import annotations

import json
import os
from typing import Any

PREFIX = "builtin:"
TINY_MODEL = "builtin:tiny"
BUILTIN_MODELS = ("tiny", "smollm2")
# The tasks of rlhf_jax.data.synthetic, used unless that module exports its own list.
_FALLBACK_DATASETS = ("arithmetic", "countdown")


def is_builtin(path: str) -> bool:
    """True for a ``builtin:<name>`` path."""
    return isinstance(path, str) and path.startswith(PREFIX)


def builtin_name(path: str) -> str:
    """The ``<name>`` of ``builtin:<name>`` (without generator knobs: ``builtin:arithmetic?max_value=4``)."""
    return path[len(PREFIX):].partition("?")[0]


def builtin_datasets() -> tuple[str, ...]:
    """Names of the synthetic data sets, from rlhf_jax.data.synthetic when it is importable."""
    try:
        from rlhf_jax.data import synthetic
    except ImportError:
        return _FALLBACK_DATASETS
    for attr in ("BUILTIN_DATASETS", "TASKS", "GENERATORS", "DATASETS"):
        names = getattr(synthetic, attr, None)
        if names:
            return tuple(sorted(names))
    return _FALLBACK_DATASETS


def resolve_model_path(path: str, revision: str | None = None) -> str:
    """A local directory for ``path``: ``builtin:tiny`` is built on first use; a Hugging Face Hub id
    (``org/name``, not an existing path) is downloaded at ``revision`` or found in the local HF cache
    (:mod:`rlhf_jax.models.hub`); other paths are expanded.

    A path that is none of these is returned unchanged (the loader reports it).
    """
    if is_builtin(path):
        name = builtin_name(path)
        if name not in BUILTIN_MODELS:
            raise ValueError(f"unknown builtin model {path!r}; available: {', '.join(PREFIX + n for n in BUILTIN_MODELS)}")
        if name == "smollm2":
            from rlhf_jax.tools import smollm2

            return smollm2.ensure()
        from rlhf_jax.tools import tiny

        return tiny.ensure()
    from rlhf_jax.models import hub

    if hub.is_repo_id(path) and not looks_local(path):
        return hub.resolve(path, revision)
    expanded = os.path.expanduser(path)
    return os.path.abspath(expanded) if os.path.isdir(expanded) else path


def model_hf_config(path: str, revision: str | None = None) -> dict[str, Any] | None:
    """The model's ``config.json`` as a dict, without building or downloading anything; None if it cannot be read.

    ``builtin:tiny`` answers from the tiny model's constants; a hub id from its cached snapshot, if any.
    """
    if is_builtin(path):
        if builtin_name(path) == "smollm2":  # known once converted
            from rlhf_jax.tools.smollm2 import DEFAULT_DIR

            return model_hf_config(DEFAULT_DIR)
        if builtin_name(path) != "tiny":
            return None
        from rlhf_jax.tools import tiny

        return dict(tiny.MODEL_CONFIG, model_type="llama")
    config_path = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(config_path) and not looks_local(path):
        from rlhf_jax.models import hub

        config_path = (hub.cached_file(path, "config.json", revision) if hub.is_repo_id(path) else None) or config_path
    if not os.path.isfile(config_path):
        return None
    with open(config_path) as fh:
        return json.load(fh)


# What a tokenizer is built from (a fast tokenizer's serialization, a sentencepiece model, a BPE or WordPiece
# vocabulary, tiktoken ranks): tokenizer_config.json alone names a class but holds no vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
TOKENIZER_SUFFIXES = (".model", ".tiktoken")


def check_model_files(key: str, path: str, *, tokenizer: bool, weights: bool) -> None:
    """Stop before any loading if the local model directory that ``key`` names lacks what the run reads from it
    (an interrupted download or copy): its tokenizer files (when ``tokenizer``), its safetensors weights (when
    ``weights``)."""
    directory = os.path.abspath(os.path.expanduser(path))
    names = sorted(os.listdir(directory))
    lacking = []
    if tokenizer and not any(n in TOKENIZER_FILES or n.endswith(TOKENIZER_SUFFIXES) for n in names):
        lacking.append("tokenizer files (tokenizer.json, vocab.json, vocab.txt, *.model or *.tiktoken)")
    if weights and not any(n.endswith(".safetensors") for n in names):
        lacking.append("weights (*.safetensors)")
    if lacking:
        raise ValueError(f"{key}: the model directory {directory} lacks {' and '.join(lacking)}; "
                         f"it holds: {', '.join(names) or 'nothing'}")


def looks_local(path: str) -> bool:
    """True if ``path`` is meant as a filesystem path (absolute, ~, ./, ../ or more than one '/')."""
    return path.startswith(("/", "~", "./", "../", ".")) or path.count("/") != 1
