"""Configuration: the schema (verl key names plus a JAX ``mesh`` section), YAML import, CLI loading, validation.

Typical use (what ``rlhf_jax.main`` does)::

    cfg = load_config_from_argv(sys.argv)          # --config=configs/grpo.py --config.x.y=v ...
    cfg = finalize(cfg, num_devices=jax.device_count(), num_processes=jax.process_count(),
                   train_dataset_size=len(train_dataset))

``config`` imports nothing from the rest of rlhf_jax but the pure :mod:`rlhf_jax.algos` (registries); turning a model
path into a directory (building ``builtin:tiny``, downloading a Hub id) is ``rlhf_jax.models.hub.resolve_model_path``.
"""

import importlib

# Each public name and its module, imported on first use: the leaf modules (``names``, ``builtin``) are then importable
# without ml_collections, which the model code and ``benchmarks/accelerator.py`` rely on.
_EXPORTS = {
    "is_builtin": "builtin", "model_hf_config": "builtin",
    "check_override_paths": "cli", "define_config_flag": "cli", "load_config_from_argv": "cli",
    "DERIVED_DOCS": "derive",
    "describe": "docs", "render_markdown": "docs",
    "Key": "key",
    "DOCS": "schema", "KEYS": "schema", "base_config": "schema", "get_key": "schema", "key_paths": "schema",
    "finalize": "validate", "resolve_mesh": "validate", "with_dataset_size": "validate",
    "apply_mapping": "yaml_import", "load_yaml": "yaml_import",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"rlhf_jax.config.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlhf_jax.config' has no attribute {name!r}")


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
