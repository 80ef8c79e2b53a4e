"""Hugging Face Hub model ids (``Qwen/Qwen2.5-0.5B-Instruct``) as local directories.

A model path that is not an existing directory and has the shape of a repo id
is fetched with ``huggingface_hub.snapshot_download``, limited to what the
loaders read (config, safetensors weights, tokenizer and chat-template
files), at a ``revision`` (branch, tag or commit). With ``HF_HUB_OFFLINE=1``
only the local cache is consulted; online, a failed download falls back to
the cache. When neither gives a snapshot, one line says what was tried.
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

# What from_pretrained and AutoTokenizer read: config.json, generation_config.json, model*.safetensors(.index.json),
# tokenizer.json / tokenizer_config.json / special_tokens_map.json / vocab.json, merges.txt, sentencepiece models,
# chat_template.jinja. No PyTorch .bin / .pt weights, no GGUF, no ONNX.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")

# huggingface_hub's repo-id rule: one optional "org/" then a name of letters, digits, '-', '_', '.'.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
_TRUE = {"1", "on", "yes", "true"}


class HubError(FileNotFoundError):
    """A hub id that could be neither downloaded nor found in the local cache (one-line message)."""


def is_repo_id(path: str) -> bool:
    """True if ``path`` reads as a hub repo id and names no existing local file or directory."""
    return (isinstance(path, str) and bool(_REPO_ID.match(path)) and ".." not in path
            and not os.path.exists(os.path.expanduser(path)))


def offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cache_dir() -> str:
    """The hub cache directory as the environment says now (HF_HUB_CACHE, else HF_HOME/hub, else the default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _short(error: Exception) -> str:
    """The first line of an exception's message, without the library's advice paragraphs."""
    text = str(error).strip().splitlines()
    first = text[0].removeprefix("Got: ") if text else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def cached_file(repo_id: str, filename: str, revision: str | None = None) -> str | None:
    """Path of ``filename`` in the cached snapshot of ``repo_id`` at ``revision``; None if not cached (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir(), revision=revision)
    except Exception:  # an invalid id or revision is reported by resolve(); here it only means "not cached"
        return None
    return found if isinstance(found, str) else None


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
