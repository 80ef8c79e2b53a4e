"""Command-line loading: ``--config=configs/grpo.py --config.algorithm.adv_estimator=rloo ...``.

Built on ``ml_collections.config_flags``: ``--config`` names a recipe file
defining ``get_config()`` (or a ``.yaml`` of verl's or ROLL's, loaded with
:func:`rlhf_jax.config.yaml_import.load_yaml`; ``--config_format`` names the format when its keys do not), and ``--config.<key>=<value>``
overrides any schema key, parsed by the key's type. Tuples take
``--config.trainer.logger="('console','jsonl')"``, a bare
``--config.data.train_files=/path/a.parquet`` (one element) or the flag
repeated. An override of a key that is not in the schema fails with a
ValueError naming it and the closest known key, before anything loads. In a config with ``stages``,
``--config.stages.<i>.<key>=<value>`` sets a key in stage ``<i>`` (its position from 0 or its ``stage_name``), and
an override of a key that a stage sets itself is refused naming that form (config/stage_overrides.py).

Two entry points: :func:`load_config_from_argv` parses an argv list on its own
(no absl app needed); :func:`define_config_flag` registers the flag on an absl
``FlagValues`` (the global ``FLAGS`` by default) for programs run with
``absl.app.run``.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags
from ml_collections import ConfigDict, config_flags

from rlhf_jax.config import schema
from rlhf_jax.config import dialects, hydra_args
from rlhf_jax.config.stage_overrides import apply_stage_overrides, split_stage_args
from rlhf_jax.config.hydra_args import is_hydra_arg
from rlhf_jax.config.yaml_import import apply_mapping, coerce, load_yaml

_HELP = "Recipe file with get_config() (configs/grpo.py) or a verl-style YAML; override keys with --config.<key>=v"


def define_config_flag(
    name: str = "config", default: str | None = None, flag_values: flags.FlagValues = flags.FLAGS
) -> flags.FlagHolder:
    """Define ``--<name>`` (a recipe file) plus its ``--<name>.<key>`` overrides on ``flag_values``."""
    return config_flags.DEFINE_config_file(name, default, _HELP, flag_values=flag_values, lock_config=True)


def override_items(argv: Sequence[str], name: str = "config") -> list[tuple[int, str, str]]:
    """(position in ``argv``, dotted key, raw value) of each override: ``--name.k=v``, ``--name.k v``,
    ``--noname.k`` (the value "False")."""
    items = []
    for i, arg in enumerate(argv):
        for prefix in (f"--{name}.", f"-{name}.", f"--no{name}.", f"-no{name}."):
            if arg.startswith(prefix):
                body = arg[len(prefix):]
                if "no" in prefix:
                    path, value = body, "False"
                elif "=" in body:
                    path, value = body.split("=", 1)
                else:
                    path, value = body, argv[i + 1] if i + 1 < len(argv) else ""
                items.append((i, path, value))
                break
    return items


def override_paths(argv: Sequence[str], name: str = "config") -> list[str]:
    """The dotted keys overridden in ``argv`` (``--name.k=v``, ``--name.k v``, ``--noname.k``)."""
    return [path for _, path, _ in override_items(argv, name)]


def check_override_paths(argv: Sequence[str], name: str = "config") -> None:
    """Raise ValueError naming the first override that is not a schema key (with a close-match hint)."""
    for path in override_paths(argv, name):
        if path not in schema.DOCS:
            if schema.is_section(path):
                raise ValueError(f"--{name}.{path} names a section; override its keys one by one "
                                 f"(e.g. --{name}.{next(p for p in schema.DOCS if p.startswith(path + '.'))}=...)")
            raise ValueError(f"--{name}.{path}: {schema.unknown_key_message(path)}")


def verl_base() -> ConfigDict:
    """The schema with verl's own value wherever our default differs (config/verl_defaults.py): what
    ``python3 -m verl.trainer.main_ppo`` starts from."""
    from rlhf_jax.config.verl_defaults import DIFFERENCES

    cfg = schema.base_config()
    for path, (value, _) in DIFFERENCES.items():
        if value is None:  # verl's null where ours has a value: kept, as when verl's ppo_trainer.yaml is loaded
            continue
        schema.set_path(cfg, path, coerce(schema.get_key(path), value))
    return cfg


def _apply_hydra(cfg: ConfigDict, hydra: dict[int, str], overrides: list[tuple[int, str, str]]) -> ConfigDict:
    """``cfg`` with verl's Hydra-style arguments (``hydra``: argv position -> argument) applied; of a key given both as
    ``key=value`` and ``--config.<key>=`` (``overrides``: their argv positions), the later argument stands."""
    settings = hydra_args.parse(hydra.values())
    last_hydra = {arg.lstrip("+~").split("=", 1)[0]: i for i, arg in hydra.items()}
    for i, path, _ in overrides:
        if path in settings and i > last_hydra[path]:
            del settings[path]  # the later --config.<key> override stands
    for path in [p for p, v in settings.items() if v is hydra_args.REMOVED]:
        if path not in schema.DOCS:
            raise ValueError(f"~{path}: {schema.unknown_key_message(path)}")
        schema.set_path(cfg, path, schema.get_key(path).default)
        del settings[path]
    return apply_mapping(dialects.nested(settings), cfg, source="command line")


def _dialect_args(hydra: dict[int, str], fmt: str) -> ConfigDict:
    """The schema config of another trainer's Hydra-style command line: the arguments read as that trainer's file
    (its defaults where they are silent; ``~key`` leaves a key at that default)."""
    settings = {k: v for k, v in hydra_args.parse(hydra.values()).items() if v is not hydra_args.REMOVED}
    translated = dialects.to_schema(dialects.nested(settings), fmt, "command line")
    return apply_mapping(dialects.nested(translated), source="command line")


def _config_file_arg(argv: list[str], name: str) -> tuple[int, int, str] | None:
    """(index, number of argv items, value) of ``--name=v`` / ``--name v``, if present."""
    for i, arg in enumerate(argv):
        for prefix in (f"--{name}=", f"-{name}="):
            if arg.startswith(prefix):
                return i, 1, arg[len(prefix):]
        if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
            return i, 2, argv[i + 1]
    return None


def load_config_from_argv(argv: Sequence[str], *, name: str = "config", default: str | None = None) -> ConfigDict:
    """Parse ``argv`` (``argv[0]`` is the program) into a locked ConfigDict.

    ``default`` is the recipe used when ``argv`` has no ``--config``. Anything in
    ``argv`` that is not ``--config`` or an override is an error.
    """
    argv, primary = hydra_args.config_file(argv)  # Hydra's --config-path/--config-name: the file --config names
    if primary is not None:
        if _config_file_arg(argv[1:], name):
            raise ValueError(f"--{name} and --config-path/--config-name both name the config file: give one")
        argv.insert(1, f"--{name}={primary}")
    hydra = {i: a for i, a in enumerate(argv) if i and is_hydra_arg(a)}  # verl's key=value / +key=value / ~key
    positions = override_items(argv, name)  # where each --config.<key> stood among them
    argv = [a for i, a in enumerate(argv) if i not in hydra]
    fmt = None
    fmt_arg = _config_file_arg(argv[1:], f"{name}_format")  # --config_format=roll: the YAML file's format
    if fmt_arg:
        i, count, fmt = fmt_arg
        del argv[1 + i : 1 + i + count]
    argv[1:], stage_args = split_stage_args(argv[1:], name)  # --config.stages.<i>.<key>=v: applied after loading
    check_override_paths(argv[1:], name)
    fv = flags.FlagValues()
    found = _config_file_arg(argv[1:], name)
    source = found[2] if found else default
    if hydra and not found and fmt not in (None, "verl"):  # another trainer's command line (verl's SFT trainer's:
        # --config_format=verl_sft data.prompt_key=... model.partial_pretrain=...): its arguments are its file
        source = f"<{fmt} command line>"
        config_flags.DEFINE_config_dict(name, _dialect_args(hydra, fmt), _HELP, flag_values=fv, lock_config=True,
                                        sys_argv=argv)
        hydra = {}
    elif hydra and not found:  # a verl command line: verl's defaults underneath, as a ppo_trainer.yaml run has
        source = "<verl defaults>"
        config_flags.DEFINE_config_dict(name, verl_base(), _HELP, flag_values=fv, lock_config=True, sys_argv=argv)
    elif source is None:
        raise ValueError(f"no --{name}=<recipe.py|file.yaml> given")
    elif source.endswith((".yaml", ".yml")):
        if found:
            i, count, _ = found
            del argv[1 + i : 1 + i + count]
        config_flags.DEFINE_config_dict(name, load_yaml(source, fmt=fmt), _HELP, flag_values=fv, lock_config=True,
                                        sys_argv=argv)
    elif fmt is not None:
        raise ValueError(f"--{name}_format={fmt} applies to a YAML file, not {source}")
    else:
        config_flags.DEFINE_config_file(name, default, _HELP, flag_values=fv, lock_config=True, sys_argv=argv)
    try:
        rest = fv(argv)
    except flags.Error as e:
        raise ValueError(str(e)) from None
    if len(rest) > 1:
        raise ValueError(f"unexpected command-line arguments: {' '.join(rest[1:])}")
    cfg = fv[name].value
    paths = override_paths(argv[1:], name)
    if source.endswith((".yaml", ".yml")) and paths:
        # Again with the overrides inside the file's ${...} references, which verl resolves after its overrides
        # (overriding actor.ppo_mini_batch_size also changes a critic.ppo_mini_batch_size that refers to it).
        cfg = load_yaml(source, overrides={p: schema.get_path(cfg, p) for p in paths}, warn=False, fmt=fmt)
    if not isinstance(cfg, ConfigDict):
        raise ValueError(f"--{name}={source}: get_config() must return an ml_collections.ConfigDict")
    if hydra:
        cfg = _apply_hydra(cfg, hydra, positions)
    plain = {path: value for _, path, value in override_items(argv[1:], name)}
    apply_stage_overrides(cfg, plain, stage_args, name)
    schema.check_known_keys(cfg)
    return cfg
