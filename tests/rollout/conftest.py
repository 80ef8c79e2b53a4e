"""Fixtures of the rollout tests: tiny random Llama and Qwen2 checkpoints, built once per session."""

from __future__ import annotations

import pytest

from .rollout_testdata import build_checkpoint


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return build_checkpoint("llama", str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> str:
    return build_checkpoint("qwen2", str(tmp_path_factory.mktemp("tiny_qwen2")))


@pytest.fixture(scope="session")
def llama_model(llama_dir):
    from rlhf_jax.models import from_pretrained

    return from_pretrained(llama_dir)
