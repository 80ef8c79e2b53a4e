"""Run parsed tool calls concurrently, each with a timeout; every fault becomes an error result for the model.

A tool runs in a daemon thread: past its timeout the call is reported as timed out and the trajectory goes
on (the thread cannot be stopped from outside; the built-in python tool kills its own child process at its
wall-clock limit, so give user tools limits of their own).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from rlhf_jax.agents.tool_calls import ToolCall
from rlhf_jax.agents.tools import Tool, get_tool


@dataclasses.dataclass(frozen=True)
class ToolResult:
    name: str
    content: str  # what the model sees: the tool's output, or the error
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0
    reward: float | None = None  # the tool's reward for the call, when it gives one


@dataclasses.dataclass
class ToolStats:
    """Counts for ``multi_turn/`` metrics."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0

    def add(self, results: list[ToolResult], parse_errors: int = 0) -> None:
        self.calls += len(results) + parse_errors
        self.errors += sum(r.error is not None for r in results) + parse_errors
        self.timeouts += sum(r.timed_out for r in results)
        self.seconds += sum(r.seconds for r in results)


def _start(call: ToolCall, tool: Tool | None, row: dict) -> tuple[Any, threading.Thread | None, list]:
    slot: list = []
    if tool is None:
        return None, None, slot
    given = {k: row[k] for k in tool.row_args if k in row}  # the row's, never the model's

    def target():
        start = time.monotonic()
        try:
            slot.append(("ok", tool.fn(**{**call.arguments, **given}), time.monotonic() - start))
        except Exception as e:  # noqa: BLE001 - any fault of a tool is the model's information
            slot.append(("error", f"{type(e).__name__}: {e}", time.monotonic() - start))

    thread = threading.Thread(target=target, daemon=True, name=f"tool-{call.name}")
    thread.start()
    return tool, thread, slot


def run_tool_calls(calls: list[ToolCall] | tuple[ToolCall, ...], timeout_s: float = 30.0,
                   tools: dict[str, Tool] | None = None, row_kwargs: dict | None = None) -> list[ToolResult]:
    """The results of ``calls`` in order; they run at the same time. ``tools`` overrides the registry;
    ``row_kwargs``: the data row's arguments per tool name (verl's ``tools_kwargs``: ``{name: {"create_kwargs":
    {...}}}``)."""
    lookup = (lambda name: tools.get(name)) if tools is not None else get_tool
    row_kwargs = row_kwargs or {}
    started = [(call, *_start(call, lookup(call.name), (row_kwargs.get(call.name) or {}).get("create_kwargs") or {}))
               for call in calls]
    deadline = time.monotonic() + timeout_s
    results = []
    for call, tool, thread, slot in started:
        if tool is None:
            message = f"unknown tool {call.name!r}"
            results.append(ToolResult(call.name, f"Error: {message}", error=message))
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if not slot:
            message = f"tool {call.name!r} timed out after {timeout_s:g} s"
            results.append(ToolResult(call.name, f"Error: {message}", error=message, timed_out=True, seconds=timeout_s))
            continue
        kind, content, seconds = slot[0]
        if kind == "error":
            results.append(ToolResult(call.name, f"Error: {content}", error=content, seconds=seconds))
        elif isinstance(content, tuple):  # (text, tool reward)
            results.append(ToolResult(call.name, str(content[0]), seconds=seconds, reward=float(content[1])))
        else:
            results.append(ToolResult(call.name, str(content), seconds=seconds))
    return results


def tool_message(result: ToolResult) -> dict[str, str]:
    """The chat message that carries a result back to the model (rendered by its chat template)."""
    return {"role": "tool", "name": result.name, "content": result.content}
