"""The configuration reference, generated from the schema (``docs/CONFIG.md``).

    python -m rlhf_jax.config docs > docs/CONFIG.md
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.config import schema
from rlhf_jax.config.derive import DERIVED_DOCS
from rlhf_jax.config.verl_compat import ALIASES, IGNORED, accepts_positive_size
from rlhf_jax.config.verl_defaults import DIFFERENCES
from rlhf_jax.config.verl_releases import releases_of

_INTRO = """# Configuration reference

Generated from `rlhf_jax/config/keys_*.py` by `python -m rlhf_jax.config docs`; do not edit by hand.

Keys follow verl's `ppo_trainer.yaml`; "verl releases" says which of verl's releases name a key so in their
`ppo_trainer.yaml` (empty: a key of rlhf_jax's own, or one verl sets elsewhere). Set them in a recipe (`configs/*.py`, `get_config()`),
on the command line (`--config.actor_rollout_ref.actor.optim.lr=1e-6`), or in a verl-style
YAML file (`--config=run.yaml`). A default of `None` is derived when the config is finalized
(the description says from what); `${a.b}` inside a string refers to another key.
"""


def _fmt(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else f"'{value}'"
    return "`" + text.replace("|", "\\|") + "`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """The whole reference: one table per top-level section, derived values, ignored verl keys."""
    lines = [_INTRO]
    section = None
    for key in schema.KEYS:
        top = key.path.split(".", 1)[0]
        if top != section:
            section = top
            lines += ["", f"## {top}", "", "| key | default | type | verl releases | description |",
                      "|---|---|---|---|---|"]
        typ = "any" if key.value_type is object else key.value_type.__name__
        doc = key.doc + (f" One of: {', '.join(map(str, key.choices))}." if key.choices else "")
        lines.append(f"| `{key.path}` | {_fmt(key.default)} | {typ} | {releases_of(key.path)} | {_cell(doc)} |")
    lines += ["", "## derived (filled by finalize, read-only)", "", "| key | description |", "|---|---|"]
    lines += [f"| `{k}` | {_cell(v)} |" for k, v in DERIVED_DOCS.items()]
    lines += _rule_tables()
    lines += ["", "## verl keys accepted with a warning and ignored", "",
              "A verl YAML may contain these; the importer logs one warning per key. Where a condition is",
              "given, other values are an error, because the feature is not implemented.", "",
              "| key pattern | why |", "|---|---|"]
    lines += [f"| `{i.pattern}` | {_cell(i.reason)}{_condition(i.accept)} |" for i in IGNORED]
    lines += ["", "## verl's other names of schema keys", "",
              "Set in a verl YAML, these set the schema key (a copy that must agree: the file's value must equal",
              "the key's, or the fallback's where the key is unset).", "",
              "| verl key | verl releases | schema key | how |", "|---|---|---|---|"]
    lines += [f"| `{a.path}` | {releases_of(a.path)} | `{a.target}` | {'sets it' if a.assign else 'must agree' + (f' (else `{a.fallback}`)' if a.fallback else '')} |"
              for a in ALIASES]
    lines += ["", "## defaults that differ from verl's", "",
              "Every other key defaults to the value of verl's generated `ppo_trainer.yaml`.", "",
              "| key | ours | verl's | why |", "|---|---|---|---|"]
    lines += [f"| `{path}` | {_fmt(schema.get_key(path).default)} | {_fmt(verl)} | {_cell(why)} |"
              for path, (verl, why) in DIFFERENCES.items()]
    lines += _optimizer_arguments()
    lines += _dialect_tables()
    lines += _refusal_table()
    return "\n".join(lines) + "\n"


def _rule_tables() -> list[str]:
    """For each key, the rules that check it (its own, and the named rules between keys), then those rules."""
    from rlhf_jax.config import validate  # noqa: F401  (imports the rule modules, which register their rules)
    from rlhf_jax.config.defaults import default_source
    from rlhf_jax.config.rule import GIVEN_RULES, RULES, rules_of

    lines = ["", "## checks per key", "",
             "Checked by `finalize` before anything is built, in this order: the rules on the config as written, the "
             "defaults filled (`None` = another key's value or a computed one), each key's own rule (declared with "
             "the key in `rlhf_jax/config/keys_*.py`), then the rules between keys, named functions of "
             "`rlhf_jax/config/rules.py` and `rules_run.py` (listed after this table). Each failure is one line "
             "naming the key.", "",
             "| key | default from | its own rule | rules between keys |", "|---|---|---|---|"]
    for key in schema.KEYS:
        own, cross, source = key.rules(), rules_of(key.path), default_source(key.path)
        if own or cross or source:
            lines.append(f"| `{key.path}` | {_cell(source or '')} | {_cell('; '.join(own))} | "
                         f"{', '.join(f'`{r.module}.{r.name}`' for r in cross)} |")
    lines += ["", "## rules between keys", "", "| rule | on | what it asks |", "|---|---|---|"]
    lines += [f"| `{r.module}.{r.name}` | {'the config as written' if r in GIVEN_RULES else 'the complete config'} | "
              f"{_cell(r.doc)} |" for r in GIVEN_RULES + RULES]
    return lines


def _optimizer_arguments() -> list[str]:
    """``optim.override_optimizer_config``: what each optimizer reads from it, from the code that checks it."""
    from rlhf_jax.config.names import OPTIMIZER_NAMES
    from rlhf_jax.config.optimizers import ADAFACTOR_DEFAULTS, ADAFACTOR_MEANING, IMPLEMENTATION_ONLY, ONLY_AT

    lines = ["", "## optimizer arguments", "",
             "`*.optim.override_optimizer_config` holds the optimizer class's further keyword arguments, named as in "
             "PyTorch (transformers for Adafactor). Adafactor reads lr from `optim.lr` and its schedule and applies "
             "`optim.weight_decay` x its step size; `optim.betas` / `optim.eps` must stay at their defaults with it. "
             "Its second moments are factored over the two largest dimensions of every parameter with two or more "
             "(transformers factors the last two of its 2-D weights: the same for matrices; the attention "
             "projections here are (embed, heads, head_dim) arrays). Arguments that only pick a PyTorch "
             f"implementation are accepted for every optimizer: {', '.join(IMPLEMENTATION_ONLY)}.", "",
             "| optimizer | argument | default | meaning |", "|---|---|---|---|"]
    lines += [f"| Adafactor | `{arg}` | {_fmt(default)} | {_cell(ADAFACTOR_MEANING[arg])} |"
              for arg, default in ADAFACTOR_DEFAULTS.items()]
    lines += [f"| {OPTIMIZER_NAMES[key]} | `{arg}` | {_fmt(value)} | this value only (the update rule built here) |"
              for key, args in ONLY_AT.items() if key != "adafactor" for arg, value in args.items()]
    return lines


def _dialect_tables() -> list[str]:
    """One table per foreign format: their key, what it becomes here (or why it does not), and their defaults."""
    from rlhf_jax.config.dialects import atorch, roll, trainer_config, trinity

    lines = []
    for name, module in (("ROLL (`rlvr_config.yaml`)", roll), ("Trinity-RFT", trinity),
                         ("TRL-based `Trainer_config.yaml`", trainer_config),
                         ("ATorch (`model` / `tokenizer` / `train`)", atorch)):
        lines += ["", f"## {name} files", "", (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "), "",
                  "Run one with `python -m rlhf_jax.main --config=FILE.yaml` (recognised by its top-level keys, or "
                  "`--config_format`); `python -m rlhf_jax.config convert FILE.yaml` prints it in rlhf_jax's keys.",
                  "", "| their key | here | note |", "|---|---|---|"]
        for rule in module.RULES:
            if rule.to is not None:
                here = f"`{rule.to}`"
            elif rule.convert is not None:
                doc = rule.convert.__doc__ or ""
                first = " ".join(line.strip() for line in doc.strip().split("\n\n")[0].split("\n"))
                here = first if first.startswith("refused") else "computed" + (": " + first if first else "")
            elif rule.used_by is not None:
                here = f"read with `{rule.used_by}`"
            else:
                here = "ignored (warned)" if rule.accept is None else "ignored (warned) for the values it allows; else refused"
            lines.append(f"| `{rule.their}` | {_cell(here)} | {_cell(rule.reason)} |")
        lines += ["", "Their defaults applied when the file omits the key:", "",
                  ", ".join(f"`{k}: {v}`" for k, v in module.DEFAULTS.items())]
    return lines


def _refusal_table() -> list[str]:
    """Every refused foreign key with the capability it asks for (``config/limits.py``)."""
    from rlhf_jax.config.limits import LIMITS, refusals

    lines = ["", "## refused keys of other trainers' files", "",
             "A key of a verl or other trainer's file stops the run (one line naming it, before anything is built) "
             "only for values that ask for something rlhf_jax does not do; its other values are honoured or "
             "ignored as the tables above say. Each refusal names what is missing, and a test checks that the "
             "schema still has no key for it (`rlhf_jax/config/limits.py`).", "",
             "| format | their key | message | what rlhf_jax does not do |", "|---|---|---|---|"]
    lines += [f"| {r.fmt} | `{r.their}` | {_cell(r.reason)} | "
              f"{_cell(LIMITS[r.limit].what) if r.limit in LIMITS else ''} |" for r in refusals()]
    return lines


def describe(path: str) -> str:
    """One line for ``path``: ``key = default  # doc`` (a ``--help``-like entry)."""
    key = schema.get_key(path)
    return f"{key.path} = {key.default!r}  # {key.doc}"


def _condition(accept) -> str:
    """When an ignored verl key is accepted: any value, any positive size, or only while its feature is off."""
    return "" if accept is None else " (any positive size)" if accept is accepts_positive_size else " (only when off)"
