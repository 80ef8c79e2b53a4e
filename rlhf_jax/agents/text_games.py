"""Grid games played in text, turn by turn, as ROLL's agentic pipeline plays them (``TrajEnvManager``).

A game (``FrozenLake``, ``Sokoban``) renders its state as a text grid and takes one action per turn, written in the
model's reply as ``action_pattern`` captures it (``<answer>Up</answer>``; ROLL's ``think_action_pattern`` captures a
``<think>`` part first). What the model reads, exactly as ROLL composes it:

- the first user message: the game's instructions (its ``env_instruction``, the meaning of each grid symbol, the
  action names), a newline, then ``agent_template`` filled with ``turn_idx`` (1), ``observation`` (the grid),
  ``actions_left`` and ``max_response_length`` (``max_tokens_per_step``); the system message is
  ``agent_system_template`` (``data.system_prompt`` here);
- after each action: ``agent_template`` for the next turn, as a user message.

A reply with no recognised action scores ``format_penalty`` (the state does not change; Sokoban counts it as a
step). The episode ends when the game says so or after ``max_steps`` actions (ROLL's env manager's limit); its
score is the sum of the turns' rewards.

Settings come from the task: ``task["env_config"]`` is one entry of ROLL's ``custom_envs`` (``max_steps``,
``max_tokens_per_step``, ``agent_template``, and the game's own ``env_config``), ``task["seed"]`` the episode's
seed: the same seed gives the same board.
"""

from __future__ import annotations

import abc
import re
from typing import Any

from rlhf_jax.agents.environment import Environment, StepResult

# ROLL's defaults (examples/config/traj_envs.yaml, and its parser's special tokens).
AGENT_TEMPLATE = ("Turn {turn_idx}:\nObservation:\n{observation}\nStrictly follow this format:\n"
                  "1. output format is '<answer> [your answer] </answer>' with no extra text. \n"
                  "2. You have {actions_left} actions left. \n"
                  "3. Max response length: {max_response_length} words (tokens).\nDecide the next action:\n")
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")


def parse_action(text: str, pattern: str, actions: dict[Any, str],
                 special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> tuple[Any, str]:
    """(the action's key in ``actions`` or None, the captured answer), as ROLL's default parser: the chat markers are
    removed, the first match of ``pattern`` counts, its first group is the answer (the second where it has more: the first is the thinking), compared without case."""
    for token in special_tokens or ():
        text = text.replace(token, "").strip()
    match = re.search(pattern, text, re.DOTALL)
    if not match or not match.groups():
        return None, ""
    answer = match.group(1 if len(match.groups()) == 1 else 2).strip()
    by_name = {str(name).lower(): key for key, name in actions.items()}
    return by_name.get(answer.lower()), answer


class TextGame(Environment):
    """A game turned into ROLL's conversation; subclasses implement ``new_board``, ``move`` and ``render``."""

    DEFAULTS: dict[str, Any] = {}  # the game's own settings (ROLL's env_config keys) and their defaults
    INSTRUCTION = ""
    GRID_VOCAB: dict[str, str] = {}
    ACTIONS: dict[Any, str] = {}

    def reset(self, task: dict) -> str:
        entry = dict(task.get("env_config") or {})
        own = dict(entry.get("env_config") or {})
        unknown = sorted(set(own) - set(self.DEFAULTS) - {"max_steps", "format_penalty", "action_pattern",
                                                          "env_instruction", "grid_vocab", "grid_lookup",
                                                          "action_lookup", "special_token_list", "render_mode"})
        if unknown:
            raise ValueError(f"{type(self).__name__}: env_config has no setting {', '.join(map(str, unknown))}")
        self.cfg = {**self.DEFAULTS, **own}
        self.pattern = str(own.get("action_pattern", r"<answer>(.*?)</answer>"))
        self.format_penalty = float(own.get("format_penalty", 0.0))
        self.special_tokens = tuple(own.get("special_token_list", SPECIAL_TOKENS) or ())
        self.vocab = dict(own.get("grid_vocab") or self.GRID_VOCAB)
        self.actions = dict(own.get("action_lookup") or self.ACTIONS)
        self.instruction = str(own.get("env_instruction") or self.INSTRUCTION)
        self.game_max_steps = int(own.get("max_steps", self.DEFAULTS.get("max_steps", 20)))
        self.max_actions = int(entry.get("max_steps", self.game_max_steps))  # the env manager's limit
        self.template = str(entry.get("agent_template") or AGENT_TEMPLATE)
        self.max_tokens = entry.get("max_tokens_per_step", 128)
        self.steps = 0
        self.success = False
        self.new_board(int(task.get("seed", 0)))
        return self.instructions() + "\n" + self._turn_text()

    def instructions(self) -> str:
        return (self.instruction + "\nThe meaning of each symbol in the state is:\n"
                + ", ".join(f"{k}: {v}" for k, v in self.vocab.items())
                + "\nYour available actions are:\n" + ", ".join(str(v) for v in self.actions.values()))

    def _turn_text(self) -> str:
        # str.format ignores the fields a template does not name, as ROLL fills only the named ones
        return self.template.format(turn_idx=self.steps + 1, observation=self.render(), suffix="",
                                    actions_left=self.max_actions - self.steps, max_response_length=self.max_tokens)

    def step(self, action: str) -> StepResult:
        key, answer = parse_action(action, self.pattern, self.actions, self.special_tokens)
        reward, over, effective = self.move(key)
        if key is None:
            reward += self.format_penalty
        self.steps += 1
        done = bool(over) or self.steps >= self.max_actions
        info = {"action_is_valid": key is not None, "action_is_effective": effective, "success": self.success,
                "answer": answer}
        return StepResult(self._turn_text(), float(reward), done, info)

    @abc.abstractmethod
    def new_board(self, seed: int) -> None:
        """Lay out a new board for episode ``seed`` (ROLL's generator for the game)."""

    @abc.abstractmethod
    def move(self, action: Any) -> tuple[float, bool, bool]:
        """Play ``action`` (a key of ACTIONS, or None for no valid action): (reward, the game is over, the state
        changed); sets ``self.success``."""

    @abc.abstractmethod
    def render(self) -> str:
        """The board as the observation text."""


def lookup(table: dict | None, default: dict) -> dict:
    """A grid lookup from a config (a mapping or [key, value] pairs; YAML may give the keys as strings) over
    ``default``."""
    return {int(k): str(v) for k, v in dict(table or default).items()}
