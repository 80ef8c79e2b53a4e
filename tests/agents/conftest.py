"""Fixtures of the agent tests: tiny random Llama and Qwen2 checkpoints with the built-in tiny tokenizer (ChatML)."""

from __future__ import annotations

import pytest

from ..train.helpers import tiny_hf_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    out = {}
    for kind, (cfg, cls) in {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}.items():
        # a wide init gives peaked next-token distributions: greedy paths have clear winners
        out[kind] = tiny_hf_checkpoint(cfg, cls, str(tmp_path_factory.mktemp(kind)), initializer_range=0.25)
    return out
