"""The SmolLM2 fetch-and-convert tool: an ordinary HF directory, built once and then left alone."""

import json
import os
import subprocess
import sys

from rlhf_jax.tools import smollm2


def test_converted_directory_is_plain_and_cached(smollm2_dir):
    files = set(os.listdir(smollm2_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", ".complete"} <= files
    cfg = json.load(open(os.path.join(smollm2_dir, "config.json")))
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    mtimes = {f: os.path.getmtime(os.path.join(smollm2_dir, f)) for f in files}
    # A second call (here through the command line) does nothing.
    proc = subprocess.run([sys.executable, "-m", "rlhf_jax.tools.smollm2", "--out", smollm2_dir],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "already at" in proc.stdout
    assert mtimes == {f: os.path.getmtime(os.path.join(smollm2_dir, f)) for f in files}
    assert smollm2.ensure(smollm2_dir, verbose=False) == smollm2_dir
