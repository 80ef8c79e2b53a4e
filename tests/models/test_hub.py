"""Hugging Face Hub ids as model paths: a cache laid out as huggingface_hub lays it out resolves offline, at the
asked revision; an id found nowhere stops the CLI with one line."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rlhf_jax.models.hub import resolve_model_path
from rlhf_jax.config.builtin import model_hf_config
from rlhf_jax.models import hub
from tests.train.helpers import cli_args, run_main

REPO_ID = "acme/tiny-chat"
MAIN_HASH = "a" * 40
V2_HASH = "b" * 40


def _snapshot(cache: str, commit: str, *, scale: float, max_positions: int) -> str:
    """One snapshot of REPO_ID: the built-in tiny checkpoint with its weights times ``scale``."""
    from rlhf_jax.tools import tiny

    snap = os.path.join(cache, "models--acme--tiny-chat", "snapshots", commit)
    shutil.copytree(tiny.ensure(), snap, ignore=shutil.ignore_patterns(".complete"))
    weights = load_file(os.path.join(snap, "model.safetensors"))
    save_file({k: (v * scale).astype(v.dtype) for k, v in weights.items()}, os.path.join(snap, "model.safetensors"),
              metadata={"format": "np"})
    config_path = os.path.join(snap, "config.json")
    text = open(config_path).read().replace('"max_position_embeddings": 512', f'"max_position_embeddings": {max_positions}')
    assert str(max_positions) in text
    with open(config_path, "w") as fh:
        fh.write(text)
    return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """HF_HUB_CACHE with REPO_ID at two commits: refs/main -> weights x1, refs/v2 -> weights x2 (and 256 positions)."""
    cache = str(tmp_path / "hub")
    main_dir = _snapshot(cache, MAIN_HASH, scale=1.0, max_positions=512)
    v2_dir = _snapshot(cache, V2_HASH, scale=2.0, max_positions=256)
    refs = os.path.join(cache, "models--acme--tiny-chat", "refs")
    os.makedirs(refs)
    for ref, commit in (("main", MAIN_HASH), ("v2", V2_HASH)):
        with open(os.path.join(refs, ref), "w") as fh:
            fh.write(commit)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, main_dir, v2_dir


def test_repo_id_shapes(tmp_path):
    assert hub.is_repo_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert not hub.is_repo_id(str(tmp_path))  # an existing directory is local
    assert not hub.is_repo_id("a/b/c") and not hub.is_repo_id("../x") and not hub.is_repo_id("org/na me")


def test_offline_cache_resolves_at_each_revision(hub_cache):
    from flax import nnx

    from rlhf_jax import models

    _, main_dir, v2_dir = hub_cache
    assert os.path.samefile(resolve_model_path(REPO_ID), main_dir)
    assert os.path.samefile(resolve_model_path(REPO_ID, "main"), main_dir)
    assert os.path.samefile(resolve_model_path(REPO_ID, "v2"), v2_dir)
    assert os.path.samefile(resolve_model_path(REPO_ID, V2_HASH), v2_dir)  # a commit hash names its snapshot
    # finalize's model checks read the cached config.json of the asked revision without downloading
    assert model_hf_config(REPO_ID)["max_position_embeddings"] == 512
    assert model_hf_config(REPO_ID, "v2")["max_position_embeddings"] == 256
    # the loaded weights are the revision's
    params = {}
    for rev in ("main", "v2"):
        state = nnx.state(models.from_pretrained(resolve_model_path(REPO_ID, rev)))
        params[rev] = [np.asarray(v.get_value()) for _, v in nnx.to_flat_state(state)]
    assert params["main"] and len(params["main"]) == len(params["v2"])
    for a, b in zip(params["main"], params["v2"]):
        np.testing.assert_allclose(b, 2 * a, rtol=1e-6)


def test_prepare_uses_the_configured_revision(hub_cache, tmp_path):
    from rlhf_jax.train.setup import prepare
    from tests.train.helpers import make_config

    _, _, v2_dir = hub_cache
    cfg = make_config(str(tmp_path / "run"), actor_rollout_ref__model__path=REPO_ID,
                      actor_rollout_ref__model__revision="v2")
    c = prepare(cfg)
    assert os.path.samefile(c.model_path, v2_dir) and os.path.samefile(c.tokenizer_path, v2_dir)
    assert c.cfg.derived.model_max_position_embeddings == 256
    assert c.cfg.actor_rollout_ref.model.path == REPO_ID  # the config keeps the id, not the cache path


def test_missing_revision_names_it(hub_cache):
    with pytest.raises(hub.HubError, match=r"'acme/tiny-chat' at revision 'v3' .*HF_HUB_OFFLINE=1"):
        resolve_model_path(REPO_ID, "v3")


def _one_line_error(result) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


def test_cli_missing_id_offline_says_what_was_tried(tmp_path):
    result = run_main(cli_args(str(tmp_path / "run"), **{"actor_rollout_ref.model.path": "acme/not-there"}),
                      env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty")}, timeout=300)
    line = _one_line_error(result)
    assert "'acme/not-there'" in line and "not in the local Hugging Face cache" in line
    assert "HF_HUB_OFFLINE=1, so no download was tried" in line


def test_cli_missing_id_online_says_both_failed(tmp_path):
    # An endpoint that refuses connections stands in for an unreachable hub.
    result = run_main(cli_args(str(tmp_path / "run"), **{"actor_rollout_ref.model.path": "acme/not-there"}),
                      env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
                           "HF_HUB_CACHE": str(tmp_path / "empty")}, timeout=300)
    line = _one_line_error(result)
    assert "downloading it from the Hugging Face Hub failed" in line
    assert "not in the local cache" in line and str(tmp_path / "empty") in line
