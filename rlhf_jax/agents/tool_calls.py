"""Tool calls in a model's text, by a parser chosen by name.

``hermes`` (Hermes / Qwen chat templates, the default): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``arguments`` may also be a JSON string. A
block that is not such an object is reported as an error for the model, not raised. Register another
format with ``@register_parser("name")`` on a ``fn(text) -> ParsedCalls``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParsedCalls:
    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]  # one message per block that could not be read as a call


_PARSERS: dict[str, Callable[[str], ParsedCalls]] = {}


def register_parser(name: str):
    def deco(fn: Callable[[str], ParsedCalls]) -> Callable[[str], ParsedCalls]:
        _PARSERS[name] = fn
        return fn
    return deco


def parse_tool_calls(text: str, parser: str = "hermes") -> ParsedCalls:
    if parser not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; registered: {', '.join(sorted(_PARSERS))}")
    return _PARSERS[parser](text)


def _call_from_object(obj: Any) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError('a tool call is a JSON object with a "name" string and "arguments"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError('"arguments" must be a JSON object')
    return ToolCall(obj["name"], args)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@register_parser("hermes")
def parse_hermes(text: str) -> ParsedCalls:
    calls, errors = [], []
    for block in _HERMES.findall(text):
        try:
            calls.append(_call_from_object(json.loads(block.strip())))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            errors.append(f"malformed tool call {block.strip()[:200]!r}: {e}")
    return ParsedCalls(tuple(calls), tuple(errors))
