"""Context parallelism by gathering keys/values, for models whose heads the split cannot divide (SmolLM2's 9 / 3).

The models here have 3 query heads and 1 key/value head (hidden 48, head_dim 16), which no split of 2, 4 or 8
divides, so Ulysses cannot run them. The packed batch of ``test_context_parallel`` (prompts shared by two
responses in a row) runs on one device and on a (context=c) mesh: per-token log-probs, the actor loss and its
gradient agree to float32 rounding through the gather path. The compiled programs show that path (all-gathers
over context, no all-to-all) and which path ``auto`` picks.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from rlhf_jax import models
from rlhf_jax.models.sequence_split import check_heads, layout_for
from rlhf_jax.parallel import make_mesh
from rlhf_jax.train.engine import Role
from tests.train.test_context_parallel import MODELS, N, R, _micros, _passes, assert_passes_equal, shared_prompt_batch

THREE_HEADS = dict(hidden_size=48, head_dim=16, num_attention_heads=3, num_key_value_heads=1)
GATHER_MODELS = {"gqa": "llama", "window": "mistral_window"}

_REFERENCE: dict = {}


def _reference(path: str, kind: str, host):
    """The unsplit passes (dense attention: rows of 32 tokens), the reference of both attention paths."""
    if kind not in _REFERENCE:
        _REFERENCE[kind] = _passes(path, make_mesh(data=1, fsdp=1, devices=jax.devices()[:1]), host, 1, "auto")[:3]
    return _REFERENCE[kind]


@pytest.mark.parametrize("kind,context,attn,context_attention", [
    ("gqa", 2, "auto", "auto"), ("window", 4, "blockwise", "auto"), ("gqa", 8, "auto", "gather")])
def test_gathered_passes_equal_unsplit(hf_checkpoint, kind, context, attn, context_attention):
    """Dense attention per device (4..16 queries x 32 keys) and the blockwise kernel (its block skipping by slot)."""
    path, _ = hf_checkpoint(GATHER_MODELS[kind], **THREE_HEADS)
    host = shared_prompt_batch(0)
    mesh = make_mesh(data=1, fsdp=1, context=context, devices=jax.devices()[:context])
    got = _passes(path, mesh, host, 1, attn, context_attention)
    assert_passes_equal(_reference(path, kind, host), got, host)
    role = got[3]
    assert any("all-gather" in p.as_text() for p in role._compiled.values() if hasattr(p, "as_text"))


def _logp_program(path: str, context: int, context_attention: str) -> str:
    mesh = make_mesh(data=2, fsdp=1, context=context, devices=jax.devices()[:2 * context])
    model = models.from_pretrained(path, mesh=mesh, attn_impl="blockwise", dtype=jnp.float32,
                                   context_attention=context_attention)
    micro = _micros(mesh, shared_prompt_batch(0), 2)[0]
    return Role(model, mesh).packed_forward_program(
        "logp", micro["input_ids"].shape, micro["logit_positions"].shape[0], (N, R), 2, temperature=1.0).as_text()


def test_the_gather_path_compiles_to_all_gathers_over_context(hf_checkpoint):
    """(data=2, context=4): the 3-head model's log-prob program gathers over context and has no all-to-all; so does
    a model whose heads divide when gather is asked for, while auto gives that model Ulysses' all-to-alls."""
    path, _ = hf_checkpoint("llama", **THREE_HEADS)
    text = _logp_program(path, 4, "auto")
    assert "all-gather" in text and "all-to-all" not in text
    path8, _ = hf_checkpoint("qwen2", **MODELS["gqa"][1])
    forced = _logp_program(path8, 4, "gather")
    assert "all-gather" in forced and "all-to-all" not in forced
    assert "all-to-all" in _logp_program(path8, 4, "auto")


def test_auto_picks_ulysses_where_the_heads_divide_else_gather(caplog):
    mesh = make_mesh(data=2, fsdp=1, context=4, devices=jax.devices()[:8])
    split = layout_for(mesh)
    with caplog.at_level(logging.INFO, logger="rlhf_jax.models.sequence_split"):
        assert split.attention_path("auto", 8) == "ulysses"
        assert split.attention_path("auto", 9) == "gather"
        assert split.attention_path("auto", 12) == "ulysses"
        assert split.attention_path("gather", 8) == "gather"
        assert split.attention_path("ulysses", 8) == "ulysses"
    assert "attention: gather" in caplog.text and "attention: ulysses" in caplog.text
    with pytest.raises(ValueError, match=r"mesh.context=4 x mesh.tensor=1 does not divide the model's 9 attention"):
        split.attention_path("ulysses", 9)
    with pytest.raises(ValueError, match="mesh.context_attention='ring' is not one of"):
        split.attention_path("ring", 8)
    check_heads(9, context=2, tensor=1, path="auto")
    check_heads(9, context=2, tensor=1, path="gather")
    with pytest.raises(ValueError, match="mesh.context=2"):
        check_heads(9, context=2, tensor=1, path="ulysses")
