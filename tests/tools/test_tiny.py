"""The tiny default model directory: loads in transformers, byte-level tokenizer, chat template, idempotence."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rlhf_jax.tools import tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return tiny.ensure(str(tmp_path_factory.mktemp("cache") / "tiny"))


def test_files_and_config(tiny_dir):
    names = set(os.listdir(tiny_dir))
    for required in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert required in names
    with open(os.path.join(tiny_dir, "config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["model_type"] == "llama"
    assert cfg["vocab_size"] == tiny.VOCAB_SIZE == 264
    assert cfg["num_key_value_heads"] == 2 and cfg["num_attention_heads"] == 4
    assert cfg["max_position_embeddings"] == 512 and cfg["tie_word_embeddings"] is True
    with open(os.path.join(tiny_dir, "generation_config.json")) as fh:
        assert json.load(fh)["eos_token_id"] == tiny.EOS_ID
    # No staging directories are left next to the result.
    assert [n for n in os.listdir(os.path.dirname(tiny_dir)) if n.startswith(".")] == []


def test_weights_statistics(tiny_dir):
    from safetensors.numpy import load_file

    w = load_file(os.path.join(tiny_dir, "model.safetensors"))
    assert "lm_head.weight" not in w  # tied
    emb = w["model.embed_tokens.weight"]
    assert emb.shape == (264, 64) and emb.dtype == np.float32
    assert abs(float(emb.std()) - tiny.INIT_STD) < 0.002 and abs(float(emb.mean())) < 0.002
    assert np.all(w["model.norm.weight"] == 1.0)
    assert w["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    # Fixed seed: the same weights every time.
    again = tiny.init_weights()
    assert all(np.array_equal(again[k], w[k]) for k in w)


def test_loads_in_transformers_without_missing_keys(tiny_dir):
    torch = pytest.importorskip("torch")
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[257, 50, 43, 51]])).logits
    assert logits.shape == (1, 4, 264) and torch.isfinite(logits).all()


def test_tokenizer_round_trips_unicode(tiny_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == 264
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == tiny.PAD_ID
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tiny.EOS_ID
    rng = np.random.default_rng()
    # Random code points from several planes (skipping surrogates), plus whitespace runs.
    points = rng.integers(1, 0x2FFFF, size=200)
    text = "".join(chr(int(p)) for p in points if not 0xD800 <= p <= 0xDFFF) + "  \n\t end"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert tok.encode("Az 9", add_special_tokens=False) == list(b"Az 9")  # id == byte value


def test_chat_template(tiny_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+30="}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == tiny.BOS_ID and ids.count(tiny.EOS_ID) == 2
    assert tok.decode(ids) == text
    no_prompt = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert not no_prompt.endswith("assistant\n")


def test_idempotent_no_rewrite(tiny_dir):
    stamps = {n: os.stat(os.path.join(tiny_dir, n)).st_mtime_ns for n in os.listdir(tiny_dir)}
    assert tiny.ensure(tiny_dir) == tiny_dir
    assert {n: os.stat(os.path.join(tiny_dir, n)).st_mtime_ns for n in os.listdir(tiny_dir)} == stamps


def test_incomplete_directory_is_rebuilt(tmp_path):
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text("{}")  # no .complete marker: an interrupted earlier run
    out = tiny.ensure(str(target))
    with open(os.path.join(out, "config.json")) as fh:
        assert json.load(fh)["vocab_size"] == 264


def test_cache_env_and_no_torch(tmp_path):
    """RLHF_JAX_CACHE picks the location, and building needs no torch."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from rlhf_jax.tools import tiny\n"
        "print(tiny.ensure())\n"
    )
    env = dict(os.environ, RLHF_JAX_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    path = out.stdout.strip().splitlines()[-1]
    assert path == os.path.join(str(tmp_path), f"tiny-llama-v{tiny.VERSION}")
    assert os.path.exists(os.path.join(path, "model.safetensors"))
