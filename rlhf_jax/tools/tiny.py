"""Build the tiny default model: a small random Llama plus a byte-level tokenizer.

The default recipe trains this model so that it runs with no download. It is
saved as an ordinary Hugging Face directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json, chat template),
so the loading path that serves it also serves real checkpoints.

No torch is needed: weights are drawn with NumPy and written with
``safetensors.numpy``; config and tokenizer files come from ``transformers``
and ``tokenizers``, which are core dependencies.

    python -m rlhf_jax.tools.tiny [--out DIR]

Idempotent and atomic: the directory is built under a temporary name next to
its destination and renamed into place once complete (marked by ``.complete``);
a complete directory is never rewritten.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from rlhf_jax.config.builtin import TINY_BOS_ID, TINY_EOS_ID, TINY_MODEL_CONFIG, TINY_PAD_ID, TINY_VOCAB_SIZE
from rlhf_jax.tools.cached_dir import build_once

VERSION = 1  # bump when the files written below change; it names the cache directory
SEED = 0
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# Reserved tokens round the vocabulary up to a multiple of 8 (264) so it shards evenly.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN) + tuple(f"<|reserved_{i}|>" for i in range(5))
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
PAD_ID, BOS_ID, EOS_ID = 256, 257, 258

# ChatML, as used by Qwen and SmolLM2 instruct models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Architecture of the tiny model (LlamaConfig keyword arguments): declared with the config, which checks prompt lengths
# against it without building the model.
MODEL_CONFIG: dict = TINY_MODEL_CONFIG
if (VOCAB_SIZE, PAD_ID, BOS_ID, EOS_ID) != (TINY_VOCAB_SIZE, TINY_PAD_ID, TINY_BOS_ID, TINY_EOS_ID):
    raise RuntimeError("rlhf_jax.config.builtin.TINY_* disagree with the tiny tokenizer's special tokens")
INIT_STD = 0.02
_MARKER = ".complete"


def default_dir() -> str:
    """``$RLHF_JAX_CACHE/tiny-llama-v{VERSION}`` (cache root defaults to ``~/.cache/rlhf_jax``)."""
    root = os.environ.get("RLHF_JAX_CACHE") or os.path.expanduser("~/.cache/rlhf_jax")
    return os.path.join(root, f"tiny-llama-v{VERSION}")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the ByteLevel alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer():
    """A byte-level tokenizer (token id == byte value for ids < 256) with ChatML special tokens.

    Returns a ``transformers.PreTrainedTokenizerFast`` with pad/eos set and the chat template attached.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for i, tok in enumerate(SPECIAL_TOKENS):
        if backend.token_to_id(tok) != 256 + i:
            raise RuntimeError(f"special token {tok} got id {backend.token_to_id(tok)}, expected {256 + i}")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[1:2]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def init_weights(seed: int = SEED) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face Llama tensor names: matrices ~ N(0, 0.02), norms = 1.

    HF stores linear weights as (out_features, in_features). Embeddings are tied, so no lm_head.
    """
    c = MODEL_CONFIG
    d, f, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * INIT_STD).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(c["vocab_size"], d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(q_out, d)
        w[p + "self_attn.k_proj.weight"] = normal(kv_out, d)
        w[p + "self_attn.v_proj.weight"] = normal(kv_out, d)
        w[p + "self_attn.o_proj.weight"] = normal(d, q_out)
        w[p + "mlp.gate_proj.weight"] = normal(f, d)
        w[p + "mlp.up_proj.weight"] = normal(f, d)
        w[p + "mlp.down_proj.weight"] = normal(d, f)
        w[p + "input_layernorm.weight"] = np.ones(d, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(d, np.float32)
    w["model.norm.weight"] = np.ones(d, np.float32)
    return w


def write(out_dir: str, seed: int = SEED) -> None:
    """Write the complete tiny model + tokenizer directory into ``out_dir`` (created if missing)."""
    from safetensors.numpy import save_file
    from transformers import GenerationConfig, LlamaConfig

    os.makedirs(out_dir, exist_ok=True)
    import transformers

    config = LlamaConfig(**MODEL_CONFIG)
    config.architectures = ["LlamaForCausalLM"]
    # transformers >= 5 names the checkpoint dtype ``dtype``; 4.x names it ``torch_dtype``.
    dtype_attr = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    setattr(config, dtype_attr, "float32")
    config.save_pretrained(out_dir)
    save_file(init_weights(seed), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    with open(os.path.join(out_dir, _MARKER), "w") as fh:
        json.dump({"version": VERSION, "seed": seed}, fh)


def ensure(out_dir: str | None = None, *, verbose: bool = False) -> str:
    """Return the absolute path of the tiny model directory, building it on first use."""
    path, built = build_once(out_dir or default_dir(), write, _MARKER)
    if built and verbose:
        print(f"tiny model written to {path}")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"output directory (default {default_dir()})")
    args = parser.parse_args(argv)
    print(ensure(args.out, verbose=False))


if __name__ == "__main__":
    main()
