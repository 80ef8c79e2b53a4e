"""Inspect configurations from the command line.

    python -m rlhf_jax.config docs                       # the markdown key reference (docs/CONFIG.md)
    python -m rlhf_jax.config keys [PREFIX]              # key = default  # doc, like --help
    python -m rlhf_jax.config show --config=configs/grpo.py [--config.k=v ...]
                                   [--finalize --num_devices=N --num_processes=P --dataset_size=S]
    python -m rlhf_jax.config convert FILE.yaml [--config_format=roll]   # the file in rlhf_jax's keys
"""

from __future__ import annotations

import argparse
import json
import sys

from rlhf_jax.config import cli, docs, schema, validate


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m rlhf_jax.config", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)  # --config=... is not --config_format
    parser.add_argument("command", choices=("docs", "keys", "show", "convert"))
    parser.add_argument("--config_format", default=None, help="convert: the file's format (default: recognised)")
    parser.add_argument("prefix", nargs="?", default="")
    parser.add_argument("--finalize", action="store_true", help="validate and add the derived section")
    parser.add_argument("--num_devices", type=int, default=1)
    parser.add_argument("--num_processes", type=int, default=1)
    parser.add_argument("--dataset_size", type=int, default=None)
    args, rest = parser.parse_known_args(argv)
    if args.command == "docs":
        sys.stdout.write(docs.render_markdown())
        return 0
    if args.command == "keys":
        for path in schema.key_paths():
            if path.startswith(args.prefix):
                print(docs.describe(path))
        return 0
    if args.command == "convert":
        try:
            sys.stdout.write(convert(args.prefix, args.config_format))
        except (KeyError, ValueError, FileNotFoundError) as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        return 0
    cfg = cli.load_config_from_argv(["rlhf_jax.config"] + rest)
    if args.finalize:
        cfg = validate.finalize(cfg, num_devices=args.num_devices, num_processes=args.num_processes,
                                train_dataset_size=args.dataset_size)
    print(json.dumps(cfg.to_dict(), indent=1, sort_keys=True, default=str))
    return 0


def convert(path: str, fmt: str | None = None) -> str:
    """The keys of a config file (any format) that differ from the schema's defaults, as rlhf_jax YAML."""
    import yaml

    from rlhf_jax.config.dialects import nested
    from rlhf_jax.config.yaml_import import load_yaml

    if not path:
        raise ValueError("convert needs a YAML file: python -m rlhf_jax.config convert FILE.yaml")
    cfg, base = load_yaml(path, fmt=fmt), schema.base_config()
    changed = {}
    for key in schema.KEYS:
        value = schema.get_path(cfg, key.path)
        if value != schema.get_path(base, key.path):
            changed[key.path] = _plain(value)
    header = f"# {path} in rlhf_jax's keys (python -m rlhf_jax.config convert); every other key has its default\n"
    return header + yaml.safe_dump(nested(changed), sort_keys=False)


def _plain(value):
    """Tuples as lists and ConfigDicts as dicts, for YAML."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return value


if __name__ == "__main__":
    sys.exit(main())
