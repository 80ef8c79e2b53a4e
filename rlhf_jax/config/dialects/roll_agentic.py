"""ROLL's agentic pipeline config (``examples/*agentic*/*.yaml``, run by ``start_agentic_pipeline.py``) onto the schema.

The file is ROLL's RLVR-style global and worker sections (:data:`roll.RULES`) plus the environments: ``custom_envs``
(one entry per tag: ``env_type``, ``max_steps``, ``max_tokens_per_step``, the prompt templates and the game's own
``env_config``), and two env managers, ``train_env_manager`` and ``val_env_manager`` (``tags`` with
``num_groups_partition`` groups each, ``group_size`` episodes per group on the same board). What that is here:

- a multi-turn rollout driven by environments (``rollout.multi_turn.environments``: the tags the managers play,
  each entry as ROLL wrote it, its ``env_type`` as the registered game: ``frozen_lake``, ``sokoban``);
- the tasks are episodes (``builtin:env_tasks?env=TAG``): one training step plays ``rollout_batch_size`` episodes,
  ``group_size`` per board (``rollout.n``), so ``rollout_batch_size / group_size`` boards (``data.train_batch_size``);
  the training set holds a fresh board per group and step for ``max_steps`` steps, shared among the train tags as
  ``num_groups_partition`` shares them; validation plays each val tag's groups once (``val_kwargs.n`` = its
  ``group_size``);
- a turn draws at most ``max_tokens_per_step`` tokens (and at most ``max_new_tokens``); an episode has at most
  ``max_steps`` turns (``max_actions_per_traj``); ``sequence_length`` bounds prompt and episode together;
- ``agent_system_template`` is the system message (``data.system_prompt``); the turn template stays with the game;
- the advantage: ROLL normalises each episode's score as ``reward_normalization`` says (by ``traj_group_id``, ROLL's
  group: ``norm_mean_type`` / ``norm_std_type`` ``group``) and then applies ``adv_estimator``, ``whiten_advantages``
  and ``advantage_clip`` as its RLVR pipeline does, so those keys are read by :mod:`roll`'s rules.
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.config.dialects import roll, roll_shaping
from rlhf_jax.config.dialects.rules import Rule, get

_A = "actor_rollout_ref."
_MT = _A + "rollout.multi_turn."
MARKERS = ("custom_envs", "train_env_manager", "val_env_manager")
GAMES = {"frozen_lake": "frozen_lake", "sokoban": "sokoban"}  # ROLL's env_type -> the registered game
_MANAGER = "roll.pipeline.agentic.env_manager.traj_env_manager.TrajEnvManager"
_GROUPING = {"traj_group_id": "group", "batch": "batch"}
_METHODS = {"mean_std": (True, True), "mean": (True, False), "identity": (False, False)}


def is_agentic(mapping: dict) -> bool:
    return any(key in mapping for key in MARKERS)


def _group(full: dict, manager: str) -> int:
    return int(get(full, f"{manager}.group_size", 8))


def _batch(value: Any, full: dict) -> dict:
    n = _group(full, "train_env_manager")
    if int(value) % n:
        raise ValueError(f"must be a multiple of train_env_manager.group_size={n} (ROLL asserts it too)")
    return {"data.train_batch_size": int(value) // n, _A + "rollout.n": n}


def _val_batch(value: Any, full: dict) -> dict:
    n = _group(full, "val_env_manager")
    if int(value) % n:
        raise ValueError(f"must be a multiple of val_env_manager.group_size={n} (ROLL asserts it too)")
    return {"data.val_batch_size": int(value) // n, _A + "rollout.val_kwargs.n": n}


def _mini_batch(value: Any, full: dict) -> dict:
    """ROLL's optimizer batch (per-device batch x accumulation x training devices, in episodes) in boards."""
    per_device = int(get(full, "actor_train.training_args.per_device_train_batch_size", 1))
    episodes = per_device * int(value) * roll.devices(full, "actor_train")
    n = _group(full, "train_env_manager")
    if episodes % n:
        raise ValueError(f"per_device_train_batch_size x gradient_accumulation_steps x devices = {episodes} episodes "
                         f"is not a whole number of groups of train_env_manager.group_size={n}")
    return {_A + "actor.ppo_mini_batch_size": episodes // n}


def _estimator(value: Any, full: dict) -> dict:
    """reward_normalization as ROLL's RLVR norm_mean_type / norm_std_type, then ROLL's estimator rules."""
    grouping = get(full, "reward_normalization.grouping", "batch")
    method = get(full, "reward_normalization.method", "identity")
    if grouping not in _GROUPING:
        raise ValueError(f"reward_normalization.grouping={grouping!r}: scores are normalised per group "
                         "(traj_group_id) or over the batch")
    if method not in _METHODS:
        raise ValueError(f"reward_normalization.method={method!r}: use mean_std, mean or identity")
    mean, std = (_GROUPING[grouping] if on else None for on in _METHODS[method])
    mean = get(full, "reward_normalization.norm_mean_type", mean)
    std = get(full, "reward_normalization.norm_std_type", std)
    return roll_shaping.estimator(value, {**full, "norm_mean_type": mean, "norm_std_type": std})


def _sampling(manager: str, prefix: str):
    """A manager's generating_args count only where actor_infer has none (ROLL then copies the train manager's to
    actor_infer and keeps the validation manager's for validation)."""
    def convert(value: Any, full: dict) -> dict:
        if get(full, "actor_infer.generating_args"):
            return {}
        name = prefix.rsplit(".", 1)[-1]
        out = {prefix: int(value) if name == "top_k" else float(value)}
        if manager == "val_env_manager":
            out[_A + "rollout.val_kwargs.do_sample"] = True
        return out
    return convert


def _manager_rules(manager: str) -> tuple[Rule, ...]:
    m, g = f"{manager}.", f"{manager}.generating_args."
    to = _A + ("rollout.val_kwargs." if manager == "val_env_manager" else "rollout.")
    return (
        Rule(m + "tags", used_by="finish (data files)"),
        Rule(m + "num_groups_partition", used_by="finish (data files)"),
        Rule(m + "group_size", used_by="rollout_batch_size / val_batch_size"),
        Rule(m + "num_env_groups", used_by="finish (data files)"),
        Rule(m + "max_env_num_per_worker", reason="episodes are played as one batch in this process"),
        Rule(m + "max_traj_per_env", reason="episodes are played as one batch in this process"),
        Rule(m + "format_penalty", reason="ROLL's games read their env_config.format_penalty"),
        Rule(m + "group_size_redundancy", reason="every episode of a group is played", accept=lambda v: not v),
        Rule(g + "temperature", convert=_sampling(manager, to + "temperature")),
        Rule(g + "top_p", convert=_sampling(manager, to + "top_p")),
        Rule(g + "top_k", convert=_sampling(manager, to + "top_k")),
        Rule(g + "max_new_tokens", used_by="finish (multi_turn.max_tokens_per_turn)"),
        Rule(g + "num_return_sequences", reason="ROLL sets it to 1: episodes per board are group_size"),
        Rule(g + "num_beams", reason="sampling draws one sequence per sample", accept=lambda v: v in (None, 1)),
    )


# Hydra variables the composed file's custom_envs interpolate (traj_envs.yaml); what they set is read there.
_VARIABLES = ("all_response_pattern", "action_pattern", "think_action_pattern", "max_actions_per_traj",
              "max_tokens_per_step", "sokoban_format_penalty", "frozen_format_penalty", "env_manager_cls",
              "agent_runner_cls", "agent_system_template", "agent_template", "single_prompt_agent_system_template",
              "single_prompt_agent_template", "custom_env")

RULES: tuple[Rule, ...] = (
    Rule("rollout_batch_size", convert=_batch),
    Rule("val_batch_size", convert=_val_batch),
    Rule("actor_train.training_args.gradient_accumulation_steps", convert=_mini_batch),
    Rule("adv_estimator", convert=_estimator),
    Rule("reward_normalization", used_by="adv_estimator"),
    Rule("actor_infer.generating_args.max_new_tokens", used_by="finish (multi_turn.max_tokens_per_turn)"),
    Rule("custom_envs", used_by="finish (multi_turn.environments)"),
    *(Rule(name, used_by="custom_envs (interpolated there)") for name in _VARIABLES),
    Rule("render_save_dir", reason="games are played in text; no frames are rendered"),
    *_manager_rules("train_env_manager"),
    *_manager_rules("val_env_manager"),
    *roll.RULES,
)

DEFAULTS: dict[str, Any] = {**roll.DEFAULTS, "train_env_manager.group_size": 8, "val_env_manager.group_size": 8}
DEFAULTS.pop("val_batch_size")  # ROLL's agentic val_batch_size has no default of its own here


def _entry(tag: str, full: dict) -> dict:
    entry = get(full, f"custom_envs.{tag}")
    if not isinstance(entry, dict):
        raise ValueError(f"an env manager plays tag {tag!r}, which custom_envs does not define")
    game = GAMES.get(str(entry.get("env_type")))
    if game is None:
        raise ValueError(f"custom_envs.{tag}.env_type={entry.get('env_type')!r}: the games here are "
                         f"{', '.join(GAMES)}")
    manager = entry.get("env_manager_cls") or _MANAGER
    if manager != _MANAGER:
        raise ValueError(f"custom_envs.{tag}.env_manager_cls={manager!r}: episodes are played as ROLL's "
                         "TrajEnvManager plays them (one conversation per episode)")
    if entry.get("agent_runner_cls"):
        raise ValueError(f"custom_envs.{tag}.agent_runner_cls: ROLL's agent runners are not supported")
    out = {"environment": game, **{k: entry[k] for k in ("max_steps", "max_tokens_per_step", "agent_template")
                                   if entry.get(k) is not None}}
    # the symbol tables as [symbol, meaning] pairs: config keys cannot be symbols such as "." (the games take both)
    out["env_config"] = {k: [[a, b] for a, b in v.items()] if k in ("grid_lookup", "grid_vocab", "action_lookup")
                         and isinstance(v, dict) else v for k, v in dict(entry.get("env_config") or {}).items()}
    return out


def _tags(full: dict, manager: str) -> list[tuple[str, int]]:
    tags = list(get(full, f"{manager}.tags") or ["SimpleSokoban"])
    parts = get(full, f"{manager}.num_groups_partition")
    groups = int(get(full, f"{manager}.num_env_groups", 128))
    if parts is None:  # ROLL divides the groups equally
        parts = [groups // len(tags) + (i < groups % len(tags)) for i in range(len(tags))]
    if len(parts) != len(tags) or sum(int(p) for p in parts) != groups:
        raise ValueError(f"{manager}.num_groups_partition={list(parts)} must give each tag its groups, "
                         f"{groups} (num_env_groups) in all")
    return [(str(t), int(p)) for t, p in zip(tags, parts)]


def _one(values: list, what: str) -> Any:
    if len(set(map(str, values))) > 1:
        raise ValueError(f"the tags played set {what} to {sorted(set(map(str, values)))}; here one run has one value")
    return values[0]


def finish(full: dict, values: dict[str, Any]) -> None:
    roll.finish(full, values)
    train, val = _tags(full, "train_env_manager"), _tags(full, "val_env_manager")
    played = dict.fromkeys(tag for tag, _ in train + val)
    envs = {tag: _entry(tag, full) for tag in played}
    raw = {tag: get(full, f"custom_envs.{tag}") for tag in played}
    steps = int(get(full, "max_steps", 500))
    boards = values["data.train_batch_size"]
    groups = sum(n for _, n in train)
    # a fresh board per group and step, each tag its share of the groups (at least one board each)
    values["data.train_files"] = tuple(f"builtin:env_tasks?env={tag}&train_size={max(boards * steps * n // groups, 1)}"
                                       for tag, n in train)
    values["data.val_files"] = tuple(f"builtin:env_tasks?env={tag}&test_size={n}" for tag, n in val)
    values[_MT + "enable"] = True
    values[_MT + "environments"] = envs
    values[_MT + "max_assistant_turns"] = max(int(e.get("max_steps", 20)) for e in envs.values())
    per_step = _one([e.get("max_tokens_per_step", 128) for e in envs.values()], "max_tokens_per_step")
    cap = get(full, "actor_infer.generating_args.max_new_tokens") or get(
        full, "train_env_manager.generating_args.max_new_tokens")
    values[_MT + "max_tokens_per_turn"] = min(int(per_step), int(cap)) if cap else int(per_step)
    infer = get(full, "actor_infer.generating_args") or {}
    if infer:  # ROLL gives both managers actor_infer's sampling: validation samples as training does
        v = _A + "rollout.val_kwargs."
        values[v + "do_sample"] = True
        values.update({v + k: (int if k == "top_k" else float)(infer[k]) for k in ("temperature", "top_p", "top_k")
                       if infer.get(k) is not None})
    system = _one([raw[t].get("agent_system_template", get(full, "agent_system_template")) for t in played],
                  "agent_system_template")
    if system:
        values["data.system_prompt"] = str(system)
