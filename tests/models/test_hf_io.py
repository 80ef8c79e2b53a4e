"""HF import -> export round trips, sequence-classification and value heads, sharded files, bad input."""

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from rlhf_jax.models import (
    CheckpointError,
    UnsupportedModelError,
    from_pretrained,
    save_pretrained,
)
from rlhf_jax.models.safetensors_io import LazyFile, save_file
from tests.conftest import left_padded_batch


def _batch(seed=0, lengths=(11, 6, 3)):
    ids, mask = left_padded_batch(np.random.default_rng(seed), 128, list(lengths))
    return ids, mask


def _torch_out(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float().numpy()


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"])
def test_roundtrip_loads_in_transformers_with_same_logits(hf_checkpoint, tmp_path, kind):
    path, ref = hf_checkpoint(kind)
    model = from_pretrained(path)
    out = save_pretrained(model, str(tmp_path / "export"))
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, mask = _batch()
    real = mask.astype(bool)
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))
    np.testing.assert_array_less(np.abs(_torch_out(reloaded.eval(), ids, mask) - ours)[real].max(), 1e-5)
    # And the exported weights are bit-identical to the original checkpoint's.
    np.testing.assert_array_equal(_torch_out(reloaded.eval(), ids, mask), _torch_out(ref, ids, mask))


@pytest.mark.parametrize("kind", ["llama_seq_cls", "qwen2_seq_cls3", "phi3_seq_cls", "gemma2_seq_cls", "gemma3_text_seq_cls"])
def test_sequence_classifier_scores_and_roundtrip(hf_checkpoint, tmp_path, kind):
    path, ref = hf_checkpoint(kind)
    ids, mask = _batch(seed=4)
    ids[mask == 0] = 0  # pad id 0: transformers pools at the rightmost non-pad token
    expected = _torch_out(ref, ids, mask)
    model = from_pretrained(path)
    scores = np.asarray(model(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))
    assert scores.shape == expected.shape
    np.testing.assert_allclose(scores, expected, atol=1e-4)
    out = save_pretrained(model, str(tmp_path / "export"))
    reloaded, info = transformers.AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    np.testing.assert_allclose(_torch_out(reloaded.eval(), ids, mask), scores, atol=1e-5)


def test_value_model_from_causal_lm_exports_as_token_classification(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("llama")
    critic = from_pretrained(path, task="token_value")
    ids, mask = _batch(seed=5)
    values = np.asarray(critic(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))
    assert values.shape == ids.shape and np.isfinite(values).all() and values.std() > 0
    out = save_pretrained(critic, str(tmp_path / "critic"))
    reloaded, info = transformers.AutoModelForTokenClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    real = mask.astype(bool)
    np.testing.assert_allclose(_torch_out(reloaded.eval(), ids, mask)[..., 0][real], values[real], atol=1e-5)
    # Our own import of the exported critic reproduces it too.
    again = np.asarray(from_pretrained(out)(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))
    np.testing.assert_allclose(again[real], values[real], atol=1e-6)


def test_sharded_export_and_import(hf_checkpoint, tmp_path):
    path, ref = hf_checkpoint("qwen2")
    model = from_pretrained(path)
    out = save_pretrained(model, str(tmp_path / "sharded"), max_shard_bytes=64 * 1024)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 2
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(files)
    again = from_pretrained(out)
    ids, mask = _batch(seed=6)
    a = np.asarray(model(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))
    b = np.asarray(again(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))
    np.testing.assert_array_equal(a, b)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_array_less(np.abs(_torch_out(reloaded, ids, mask) - a)[mask.astype(bool)].max(), 1e-5)


def test_transformers_sharded_checkpoint_imports(hf_checkpoint, tmp_path):
    _, ref = hf_checkpoint("llama")
    out = str(tmp_path / "hf_sharded")
    ref.save_pretrained(out, max_shard_size="100KB")
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    ids, mask = _batch(seed=7)
    ours = np.asarray(from_pretrained(out)(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))
    np.testing.assert_array_less(np.abs(_torch_out(ref, ids, mask) - ours)[mask.astype(bool)].max(), 1e-4)


def test_bfloat16_checkpoint_and_export(hf_checkpoint, tmp_path):
    _, ref = hf_checkpoint("llama")
    out = str(tmp_path / "bf16")
    ref.to(torch.bfloat16).save_pretrained(out)
    model = from_pretrained(out, dtype=jnp.bfloat16)
    assert model.model.embed_tokens[...].dtype == jnp.bfloat16
    exported = save_pretrained(model, str(tmp_path / "bf16_export"))
    lazy = LazyFile(os.path.join(exported, "model.safetensors"))
    original = LazyFile(os.path.join(out, "model.safetensors"))
    for name in original.keys():
        assert lazy.get(name).dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(lazy.get(name), original.get(name))
    assert json.load(open(os.path.join(exported, "config.json")))["torch_dtype"] == "bfloat16"


# ---- bad input: each a clear error from our code, not from deep inside JAX ----


def test_directory_without_weights(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("llama")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no weights in .*model.safetensors"):
        from_pretrained(path)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(str(tmp_path))


def test_mismatched_shape_names_the_tensor(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    lazy = LazyFile(os.path.join(path, "model.safetensors"))
    tensors = {name: np.array(lazy.get(name)) for name in lazy.keys()}
    del lazy
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = np.zeros((95, 64), np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight has shape \(95, 64\).*\(96, 64\)"):
        from_pretrained(path)


def test_fused_tensor_of_the_wrong_size_is_named(hf_checkpoint):
    path, _ = hf_checkpoint("phi3")
    lazy = LazyFile(os.path.join(path, "model.safetensors"))
    tensors = {name: np.array(lazy.get(name)) for name in lazy.keys()}
    del lazy
    name = "model.layers.0.self_attn.qkv_proj.weight"  # 64 query + 2 x 32 key/value rows
    tensors[name] = tensors[name][:112]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"qkv_proj\.weight has 112 rows, config\.json implies 128"):
        from_pretrained(path)


def test_missing_tensor_is_named(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    lazy = LazyFile(os.path.join(path, "model.safetensors"))
    tensors = {name: np.array(lazy.get(name)) for name in lazy.keys() if name != "model.layers.0.self_attn.k_proj.bias"}
    del lazy
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks tensors.*model\.layers\.0\.self_attn\.k_proj\.bias"):
        from_pretrained(path)


def test_unknown_model_type(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*supported model types: llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3_text"):
        from_pretrained(path)


def test_corrupt_safetensors_file(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError, match="safetensors"):
        from_pretrained(path)
