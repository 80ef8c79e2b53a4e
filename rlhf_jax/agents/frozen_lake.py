"""FrozenLake as ROLL plays it: gymnasium's FrozenLake on a random map, rendered as a text grid.

The map is ``size`` x ``size`` (default 4); each cell is frozen with probability ``p`` (0.8), else a hole; start
and goal are two random distinct cells, and the map is redrawn until the goal can be reached. The episode's seed
draws the map (gymnasium's seeded generator, so the same seed gives ROLL's map) and seeds the slippery moves
(``is_slippery``: the move goes the intended way with gymnasium's ``success_rate``, else to either side).

Actions ``Left``, ``Down``, ``Right``, ``Up``. Reaching the goal scores 1 and ends the game; falling into a hole
scores 0 and ends it. Grid: ``P`` player, ``_`` frozen, ``O`` hole, ``G`` goal, ``X`` player in a hole, ``√``
player on the goal (``grid_lookup`` / ``grid_vocab`` rename them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlhf_jax.agents.environment import register_environment
from rlhf_jax.agents.text_games import TextGame, lookup

_GRID = {0: "P", 1: "_", 2: "O", 3: "G", 4: "X", 5: "√"}
_CELL = {b"F": 1, b"H": 2, b"G": 3}  # a cell's index in the grid lookup (the start is frozen ice)


def _reachable(board: np.ndarray) -> bool:
    """Whether the goal can be reached from the start without crossing a hole."""
    size = board.shape[0]
    start = tuple(int(i) for i in np.argwhere(board == "S")[0])
    seen, frontier = set(), [start]
    while frontier:
        r, c = frontier.pop()
        if (r, c) in seen:
            continue
        seen.add((r, c))
        for dr, dc in ((1, 0), (0, 1), (-1, 0), (0, -1)):
            rr, cc = r + dr, c + dc
            if 0 <= rr < size and 0 <= cc < size:
                if board[rr][cc] == "G":
                    return True
                if board[rr][cc] != "H":
                    frontier.append((rr, cc))
    return False


def random_map(size: int, p: float, seed: int | None) -> list[str]:
    """A map with a path from S to G, drawn as ROLL draws it (same generator, same order of draws)."""
    from gymnasium.utils import seeding  # imported on first use: a run without FrozenLake never loads gymnasium

    rng, _ = seeding.np_random(seed)
    while True:
        board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])
        start = tuple(rng.integers(size, size=2))
        goal = tuple(rng.integers(size, size=2))
        if start != goal:
            board[start], board[goal] = "S", "G"
            if _reachable(board):
                return ["".join(row) for row in board]


@register_environment("frozen_lake")
class FrozenLake(TextGame):
    DEFAULTS = {"size": 4, "p": 0.8, "is_slippery": True, "map_seed": None, "max_steps": 20}
    INSTRUCTION = ("You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to the "
                   "unintended direction due to the slippery ice. The answer must be one of action in a turn, format "
                   "is <answer>Right</answer>")
    GRID_VOCAB = {"P": "player", "_": "empty", "O": "hole", "G": "goal", "X": "player in hole", "√": "player on goal"}
    ACTIONS = {0: "Left", 1: "Down", 2: "Right", 3: "Up"}

    def new_board(self, seed: int) -> None:
        self.grid = lookup(self.cfg.get("grid_lookup"), _GRID)
        self.set_map(random_map(int(self.cfg["size"]), float(self.cfg["p"]), seed), seed)

    def set_map(self, desc: list[str], seed: int = 0) -> None:
        """Play on ``desc`` (rows of S, F, H, G); ``seed`` seeds the slippery moves."""
        from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

        self.game = FrozenLakeEnv(desc=desc, is_slippery=bool(self.cfg["is_slippery"]))
        self.game.reset(seed=seed)

    def _cell(self) -> bytes:
        return self.game.desc[int(self.game.s) // self.game.ncol, int(self.game.s) % self.game.ncol]

    def move(self, action: Any) -> tuple[float, bool, bool]:
        if action is None:
            return 0.0, False, False
        before = int(self.game.s)
        _, reward, terminated, _, _ = self.game.step(int(action))
        self.success = self._cell() == b"G"
        return float(reward), bool(terminated), int(self.game.s) != before

    def render(self) -> str:
        rows = []
        player = divmod(int(self.game.s), self.game.ncol)
        here = {b"H": 4, b"G": 5}.get(self._cell(), 0)
        for r, row in enumerate(self.game.desc):
            rows.append("".join(self.grid.get(here if (r, c) == player else _CELL.get(bytes(cell), 1), "?")
                                for c, cell in enumerate(row)))
        return "\n".join(rows)


# ROLL's tags for FrozenLake (examples/config/traj_envs.yaml): deterministic moves, one action per turn.
@register_environment("FrozenLake")
class RollFrozenLake(FrozenLake):
    DEFAULTS = {**FrozenLake.DEFAULTS, "is_slippery": False, "max_steps": 10}


@register_environment("FrozenLakeThink")
class RollFrozenLakeThink(RollFrozenLake):
    """Answers as ``<think>...</think><answer>...</answer>`` unless the task's env_config says otherwise."""

    def reset(self, task: dict) -> str:
        entry = dict(task.get("env_config") or {})
        own = {"action_pattern": r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", **dict(entry.get("env_config") or {})}
        return super().reset({**task, "env_config": {**entry, "env_config": own}})
