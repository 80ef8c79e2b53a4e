"""Hugging Face Hub model ids (``Qwen/Qwen2.5-0.5B-Instruct``) as local directories.

A model path that is not an existing directory and has the shape of a repo id
is fetched with ``huggingface_hub.snapshot_download``, limited to what the
loaders read (config, safetensors weights, tokenizer and chat-template
files), at a ``revision`` (branch, tag or commit). With ``HF_HUB_OFFLINE=1``
only the local cache is consulted; online, a failed download falls back to
the cache. When neither gives a snapshot, one line says what was tried. :func:`resolve_model_path` turns any model
path of a config (builtin name, hub id, directory) into a local directory, building builtin models on first use.
"""

from __future__ import annotations

import logging
import os

from rlhf_jax.config.builtin import (PREFIX, builtin_name, cached_file, hub_cache_dir, is_builtin,  # noqa: F401
                                     is_repo_id, looks_local)
from rlhf_jax.config.names import BUILTIN_MODELS

log = logging.getLogger(__name__)

# What from_pretrained and AutoTokenizer read: config.json, generation_config.json, model*.safetensors(.index.json),
# tokenizer.json / tokenizer_config.json / special_tokens_map.json / vocab.json, merges.txt, sentencepiece models,
# chat_template.jinja. No PyTorch .bin / .pt weights, no GGUF, no ONNX.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")

_TRUE = {"1", "on", "yes", "true"}


class HubError(FileNotFoundError):
    """A hub id that could be neither downloaded nor found in the local cache (one-line message)."""


def offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


cache_dir = hub_cache_dir


def _short(error: Exception) -> str:
    """The first line of an exception's message, without the library's advice paragraphs."""
    text = str(error).strip().splitlines()
    first = text[0].removeprefix("Got: ") if text else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def resolve(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot directory of ``repo_id`` at ``revision`` (None = the default branch).

    Downloads the loader's files unless HF_HUB_OFFLINE is set; uses the cache when offline or when the
    download fails. Raises :class:`HubError` naming the id, the revision and both attempts.
    """
    from huggingface_hub import snapshot_download

    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    cache = cache_dir()
    download_error = None
    if not offline():
        try:
            return snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=list(ALLOW_PATTERNS))
        except Exception as e:  # noqa: BLE001 - network, auth, missing repo or revision: try the cache next
            download_error = e
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (or an id the library rejects): reported below
        pass
    else:
        if download_error is not None:
            log.warning("model %s: download failed (%s); using the cached snapshot %s", where,
                        _short(download_error), path)
        return path
    if download_error is None:
        raise HubError(f"model {where} is not a local directory and not in the local Hugging Face cache ({cache}); "
                       f"HF_HUB_OFFLINE=1, so no download was tried (unset it, or fill the cache with "
                       f"`hf download {repo_id}`)")
    raise HubError(f"model {where} is not a local directory; downloading it from the Hugging Face Hub failed "
                   f"({_short(download_error)}) and it is not in the local cache ({cache})")


def resolve_model_path(path: str, revision: str | None = None) -> str:
    """A local directory for ``path``: ``builtin:tiny`` is built on first use; a Hugging Face Hub id
    (``org/name``, not an existing path) is downloaded at ``revision`` or found in the local HF cache
    (:func:`resolve`); other paths are expanded.

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
    if is_repo_id(path) and not looks_local(path):
        return resolve(path, revision)
    expanded = os.path.expanduser(path)
    return os.path.abspath(expanded) if os.path.isdir(expanded) else path
