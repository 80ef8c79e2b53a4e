"""Command-line tools: fetch the real SmolLM2 model, build the tiny default model."""
