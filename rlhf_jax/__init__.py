"""rlhf_jax: reinforcement-learning post-training of language models in one JAX program."""

__version__ = "0.1.0"
