"""Model and data paths as the config names them, read without building or downloading anything.

``actor_rollout_ref.model.path = "builtin:tiny"`` names the small random Llama of :mod:`rlhf_jax.tools.tiny`
(its architecture is :data:`TINY_MODEL_CONFIG`); ``"builtin:smollm2"`` the real SmolLM2-135M-Instruct, converted on
first use into :data:`SMOLLM2_DIR` by :mod:`rlhf_jax.tools.smollm2`; ``data.train_files = ("builtin:arithmetic",)``
names a synthetic data set generated on first use by :mod:`rlhf_jax.data`. A Hugging Face Hub id (``org/name``) is
read from the local HF cache here; ``rlhf_jax.models.hub.resolve_model_path`` builds or downloads what is missing.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

PREFIX = "builtin:"
TINY_MODEL = "builtin:tiny"

# The builtin:tiny model's architecture (LlamaConfig keyword arguments). Its tokenizer (rlhf_jax.tools.tiny) has the
# 256 bytes, then pad, bos, eos and 5 reserved special tokens.
TINY_PAD_ID, TINY_BOS_ID, TINY_EOS_ID = 256, 257, 258
TINY_VOCAB_SIZE = 256 + 8
TINY_MODEL_CONFIG: dict = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": TINY_BOS_ID,
    "eos_token_id": TINY_EOS_ID,
    "pad_token_id": TINY_PAD_ID,
}


def cache_root() -> str:
    """Where builtin models are built: ``$RLHF_JAX_CACHE``, else ``~/.cache/rlhf_jax``."""
    return os.environ.get("RLHF_JAX_CACHE") or os.path.expanduser("~/.cache/rlhf_jax")


SMOLLM2_DIR = os.path.join(os.environ.get("RLHF_JAX_CACHE", os.path.expanduser("~/.cache/rlhf_jax")),
                           "smollm2-135m-instruct")

# huggingface_hub's repo-id rule: one optional "org/" then a name of letters, digits, '-', '_', '.'.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_builtin(path: str) -> bool:
    """True for a ``builtin:<name>`` path."""
    return isinstance(path, str) and path.startswith(PREFIX)


def builtin_name(path: str) -> str:
    """The ``<name>`` of ``builtin:<name>`` (without generator knobs: ``builtin:arithmetic?max_value=4``)."""
    return path[len(PREFIX):].partition("?")[0]


def is_repo_id(path: str) -> bool:
    """True if ``path`` reads as a hub repo id and names no existing local file or directory."""
    return (isinstance(path, str) and bool(_REPO_ID.match(path)) and ".." not in path
            and not os.path.exists(os.path.expanduser(path)))


def hub_cache_dir() -> str:
    """The hub cache directory as the environment says now (HF_HUB_CACHE, else HF_HOME/hub, else the default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def cached_file(repo_id: str, filename: str, revision: str | None = None) -> str | None:
    """Path of ``filename`` in the cached snapshot of ``repo_id`` at ``revision``; None if not cached (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=hub_cache_dir(), revision=revision)
    except Exception:  # an invalid id or revision is reported when the model is resolved; here it means "not cached"
        return None
    return found if isinstance(found, str) else None


def model_hf_config(path: str, revision: str | None = None) -> dict[str, Any] | None:
    """The model's ``config.json`` as a dict, without building or downloading anything; None if it cannot be read.

    ``builtin:tiny`` answers from the tiny model's constants; a hub id from its cached snapshot, if any.
    """
    if is_builtin(path):
        if builtin_name(path) == "smollm2":  # known once converted
            return model_hf_config(SMOLLM2_DIR)
        if builtin_name(path) != "tiny":
            return None
        return dict(TINY_MODEL_CONFIG, model_type="llama")
    config_path = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(config_path) and not looks_local(path):
        config_path = (cached_file(path, "config.json", revision) if is_repo_id(path) else None) or config_path
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
