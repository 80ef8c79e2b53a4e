"""Workflows (Trinity-RFT's notion): a function that drives the policy through one task and returns its reward.

A workflow is ``fn(client, task) -> float``: ``client`` is an OpenAI-style ``ChatClient`` over the in-process
sampler (``client.chat.completions.create(messages=..., tools=...)``), ``task`` the data row (``prompt``,
``ground_truth``, its ``extra_info`` keys and ``workflow_args``: ``rollout.multi_turn.workflow_args``, Trinity's
``workflow_args``). Whatever the agent does between calls (tools, parsing, its own
prompts), the episode it produced is one token sequence (``ChatClient.trajectory``) and is trained with the
returned reward. Register one with ``@register_workflow("name")`` or name it as ``path/to/file.py:function``.
"""

from __future__ import annotations

from typing import Any, Callable

from rlhf_jax.agents.loading import load_from_file

Workflow = Callable[[Any, dict], float]
_WORKFLOWS: dict[str, Workflow] = {}


def register_workflow(name: str) -> Callable[[Workflow], Workflow]:
    def deco(fn: Workflow) -> Workflow:
        _WORKFLOWS[name] = fn
        return fn
    return deco


def load_workflow(spec: str, key: str = "workflow") -> Workflow:
    """The workflow a registered name or ``path.py:function`` names."""
    if ":" not in spec:
        if spec not in _WORKFLOWS:
            raise ValueError(f"{key}={spec!r} is not a registered workflow (registered: "
                             f"{', '.join(sorted(_WORKFLOWS)) or 'none'}); or give path/to/file.py:function")
        return _WORKFLOWS[spec]
    fn = load_from_file(spec, key)
    if not callable(fn):
        raise ValueError(f"{key}: {spec} is not a function")
    return fn
