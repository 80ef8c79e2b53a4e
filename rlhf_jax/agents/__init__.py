"""Agentic rollouts: tools, tool-call parsing, the multi-turn loop, environments (ROLL's FrozenLake and Sokoban among them), workflows and a chat client.

Host-side pieces around the sampler: the model's text is parsed into tool calls (``parse_tool_calls``), the calls
run concurrently with timeouts (``run_tool_calls``; every fault comes back to the model as an error message), and
``run_turns`` drives a batch of conversations on a ``rollout.ConversationSampler`` (decode a turn, answer it with
tool results or an ``Environment``'s observation, continue from the device KV cache). ``ChatClient`` offers
``client.chat.completions.create`` over the same sampler for agents written against the OpenAI API
(``workflows``), recording the exact token ids and log-probs. ``multi_turn`` turns a prompt batch into the
trainer's multi-turn ``RolloutBatch`` with these pieces.
"""

from rlhf_jax.agents.executor import ToolResult, ToolStats, run_tool_calls, tool_message
from rlhf_jax.agents.tool_calls import ParsedCalls, ToolCall, parse_tool_calls, register_parser
from rlhf_jax.agents.tools import Tool, get_tool, register_tool, tool_names
from rlhf_jax.agents.turns import Reply, Trajectory, TurnSettings, run_turns, tool_reply
from rlhf_jax.agents.environment import (Environment, StepResult, environment_reply, load_environment,  # noqa: I001
                                         register_environment)
from rlhf_jax.agents import frozen_lake, sokoban  # noqa: F401,I001 - registers the games (ROLL's tags too)
from rlhf_jax.agents.client import ChatClient
from rlhf_jax.agents.workflows import load_workflow, register_workflow

__all__ = ["ChatClient", "Environment", "ParsedCalls", "Reply", "StepResult", "Tool", "ToolCall", "ToolResult",
           "ToolStats", "Trajectory", "TurnSettings", "environment_reply", "get_tool", "load_environment",
           "load_workflow", "parse_tool_calls", "register_environment", "register_parser", "register_tool",
           "register_workflow", "run_tool_calls", "run_turns", "tool_message", "tool_names", "tool_reply"]
