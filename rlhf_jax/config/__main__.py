"""Inspect configurations from the command line.

    python -m rlhf_jax.config docs                       # the markdown key reference (docs/CONFIG.md)
    python -m rlhf_jax.config keys [PREFIX]              # key = default  # doc, like --help
    python -m rlhf_jax.config show --config=configs/grpo.py [--config.k=v ...]
                                   [--finalize --num_devices=N --num_processes=P --dataset_size=S]
"""

from __future__ import annotations

import argparse
import json
import sys

from rlhf_jax.config import cli, docs, schema, validate


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m rlhf_jax.config", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("docs", "keys", "show"))
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
    cfg = cli.load_config_from_argv(["rlhf_jax.config"] + rest)
    if args.finalize:
        cfg = validate.finalize(cfg, num_devices=args.num_devices, num_processes=args.num_processes,
                                train_dataset_size=args.dataset_size)
    print(json.dumps(cfg.to_dict(), indent=1, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
