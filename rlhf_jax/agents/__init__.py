"""Tools for agentic rollouts: tool-call parsing, a tool registry with built-ins, and a concurrent executor.

These are the host-side parts of a multi-turn rollout: the model's text is parsed into tool calls
(``parse_tool_calls``), the calls run concurrently with timeouts (``run_tool_calls``), and every fault
(malformed call, unknown tool, a tool that raises or hangs) comes back as an error message for the model
instead of stopping the run.
"""

from rlhf_jax.agents.executor import ToolResult, ToolStats, run_tool_calls, tool_message
from rlhf_jax.agents.tool_calls import ParsedCalls, ToolCall, parse_tool_calls, register_parser
from rlhf_jax.agents.tools import Tool, get_tool, register_tool, tool_names

__all__ = ["ParsedCalls", "Tool", "ToolCall", "ToolResult", "ToolStats", "get_tool", "parse_tool_calls",
           "register_parser", "register_tool", "run_tool_calls", "tool_message", "tool_names"]
