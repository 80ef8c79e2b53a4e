"""Configuration: the schema (verl key names plus a JAX ``mesh`` section), YAML import, CLI loading, validation.

Typical use (what ``rlhf_jax.main`` does)::

    cfg = load_config_from_argv(sys.argv)          # --config=configs/grpo.py --config.x.y=v ...
    cfg = finalize(cfg, num_devices=jax.device_count(), num_processes=jax.process_count(),
                   train_dataset_size=len(train_dataset))

``config`` imports nothing from the rest of rlhf_jax but the pure :mod:`rlhf_jax.algos` (registries); turning a model
path into a directory (building ``builtin:tiny``, downloading a Hub id) is ``rlhf_jax.models.hub.resolve_model_path``.
"""

from rlhf_jax.config.builtin import is_builtin, model_hf_config
from rlhf_jax.config.cli import check_override_paths, define_config_flag, load_config_from_argv
from rlhf_jax.config.derive import DERIVED_DOCS
from rlhf_jax.config.docs import describe, render_markdown
from rlhf_jax.config.key import Key
from rlhf_jax.config.schema import DOCS, KEYS, base_config, get_key, key_paths
from rlhf_jax.config.validate import finalize, resolve_mesh, with_dataset_size
from rlhf_jax.config.yaml_import import apply_mapping, load_yaml

__all__ = [
    "DERIVED_DOCS",
    "DOCS",
    "KEYS",
    "Key",
    "apply_mapping",
    "base_config",
    "check_override_paths",
    "define_config_flag",
    "describe",
    "finalize",
    "get_key",
    "is_builtin",
    "key_paths",
    "load_config_from_argv",
    "load_yaml",
    "model_hf_config",
    "render_markdown",
    "resolve_mesh",
    "with_dataset_size",
]
