"""``actor_rollout_ref.rollout.multi_turn`` -> ``TurnSettings``: the tools by name, checked before any model loads.

Tools come from ``multi_turn.tools`` (registered names: the built-ins ``calculator`` and ``python``, or tools a
user's file registers) and from ``multi_turn.tool_config_path``, a YAML file in verl's layout::

    tools:
      - class_name: anything            # not imported: the name below picks a registered tool
        config: {type: native}
        tool_schema: {type: function, function: {name: calculator, description: ..., parameters: {...}}}

A ``tool_schema`` given in the file replaces the registered tool's schema in the prompt (the function stays the
registered one). Every fault is a ``ValueError`` of one line naming the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlhf_jax.agents.environment import load_environment
from rlhf_jax.agents.interactions import read_config
from rlhf_jax.agents.loading import read_yaml_file
from rlhf_jax.agents.tool_calls import _PARSERS
from rlhf_jax.agents.workflows import load_workflow
from rlhf_jax.agents.tools import Tool, get_tool, tool_names
from rlhf_jax.agents.turns import TurnSettings

KEY = "actor_rollout_ref.rollout.multi_turn"


def _tool(name: Any, where: str) -> Tool:
    if not isinstance(name, str) or get_tool(name) is None:
        raise ValueError(f"{where} names tool {name!r}, which is not registered; registered tools: "
                         f"{', '.join(tool_names())}")
    return get_tool(name)


def tools_from_file(path: str) -> list[Tool]:
    """The tools a verl-style tool config file lists (see the module doc)."""
    where = f"{KEY}.tool_config_path={path}"
    doc = read_yaml_file(path, where)
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected a 'tools:' list of entries with tool_schema.function.name")
    out = []
    for entry in entries:
        schema = entry.get("tool_schema") if isinstance(entry, dict) else None
        function = schema.get("function") if isinstance(schema, dict) else None
        name = function.get("name") if isinstance(function, dict) else (entry.get("name") if isinstance(entry, dict)
                                                                         else None)
        tool = _tool(name, where)
        if isinstance(function, dict):
            tool = dataclasses.replace(tool, description=function.get("description", tool.description),
                                       parameters=function.get("parameters", tool.parameters))
        out.append(tool)
    return out


def turn_settings(mt: Any, response_length: int) -> TurnSettings:
    """The settings of a finalized ``multi_turn`` section (a ConfigDict or mapping): the names it gives are looked up in
    the registries (tools, tool-call parsers, environments, workflows; a user's file may add to them). Raises one line
    naming the key. The rules on the values alone are the config's (``rlhf_jax.config.rules_run``)."""
    get = (lambda k: mt.get(k)) if hasattr(mt, "get") else (lambda k: getattr(mt, k, None))  # noqa: E731
    if get("format") not in _PARSERS:
        raise ValueError(f"{KEY}.format={get('format')!r} is not a registered tool-call parser; registered: "
                         f"{', '.join(sorted(_PARSERS))}")
    tools = [_tool(name, f"{KEY}.tools") for name in (get("tools") or ())]
    if get("tool_config_path"):
        tools += tools_from_file(str(get("tool_config_path")))
    if get("environment"):
        load_environment(str(get("environment")), f"{KEY}.environment")
    elif get("workflow"):
        load_workflow(str(get("workflow")), f"{KEY}.workflow")
    if get("interaction_config_path"):  # its classes imported, nothing started
        read_config(str(get("interaction_config_path")))
    for name, entry in dict(get("environments") or {}).items():
        load_environment(str(entry["environment"]), f"{KEY}.environments.{name}.environment")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"{KEY}: tool {next(n for n in names if names.count(n) > 1)!r} is listed twice")
    turns = get("max_assistant_turns")
    user_turns = get("max_user_turns")
    return TurnSettings(
        response_length=int(response_length),
        max_assistant_turns=int(turns) if turns is not None else int(response_length),
        max_user_turns=int(user_turns) if user_turns is not None else int(response_length),
        max_tokens_per_turn=None if get("max_tokens_per_turn") is None else int(get("max_tokens_per_turn")),
        format=str(get("format")),
        tool_timeout_s=float(get("tool_timeout_s")),
        tools=tuple(tools),
        max_parallel_calls=int(get("max_parallel_calls") or 1),
        max_tool_response_length=None if get("max_tool_response_length") is None
        else int(get("max_tool_response_length")),
        tool_response_truncate_side=str(get("tool_response_truncate_side")),
    )
