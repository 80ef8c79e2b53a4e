"""Sokoban as ROLL plays it (gym-sokoban's rules and room generator), rendered as a text grid.

Rules: ``Up``, ``Down``, ``Left``, ``Right`` move the player, pushing a box that is in the way when the cell behind
it is free (floor or an empty target); walls and a second box block. Every action costs 0.1; pushing a box onto a
target scores +1, off a target -1; when every box is on a target the game is won (+10) and ends. It also ends after
the game's ``max_steps`` actions. A reply with no valid action counts as a step that does nothing.

Rooms (``dim_room``, ``num_boxes``, ``search_depth``): a random walk carves the floor (``1.7 x (rows + cols)``
steps), the player and the boxes (on their targets) are placed at random, then the game is played backwards
(the player pulls boxes) by a depth-first search up to ``search_depth`` moves, keeping the state that moved the
boxes furthest; finally the player may wander up to 3 cells. The draws follow gym-sokoban's order from a Python
``random.Random(seed)`` and a NumPy ``RandomState(seed)`` (what ROLL seeds), so a seed gives ROLL's room; where no
room can be made, the next seed (seed + 1) is tried, where ROLL retries with a hash of the seed.

Grid: ``#`` wall, ``_`` floor, ``O`` target, ``√`` box on target, ``X`` box, ``P`` player, ``S`` player on target.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from rlhf_jax.agents.environment import register_environment
from rlhf_jax.agents.text_games import TextGame, lookup

WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = range(7)
_GRID = {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"}
_STEP = {0: (-1, 0), 1: (1, 0), 2: (0, -1), 3: (0, 1)}  # up, down, left, right
_MASKS = [[[0, 0, 0], [1, 1, 1], [0, 0, 0]], [[0, 1, 0], [0, 1, 0], [0, 1, 0]], [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
          [[0, 0, 0], [1, 1, 0], [1, 1, 0]], [[0, 0, 0], [0, 1, 1], [0, 1, 0]]]


class _Rooms:
    """gym-sokoban's generator with its own random streams (``py``: Python's, ``np``: NumPy's legacy one)."""

    def __init__(self, seed: int):
        self.py, self.np = random.Random(seed), np.random.RandomState(seed % 2**32)

    def topology(self, dim: tuple[int, int], steps: int, p_turn: float = 0.35) -> np.ndarray:
        rows, cols = dim
        directions = [(1, 0), (0, 1), (-1, 0), (0, -1)]
        direction = self.py.sample(directions, 1)[0]
        pos = np.array([self.py.randint(1, rows - 1), self.py.randint(1, cols - 1)])
        level = np.zeros(dim, dtype=int)
        for _ in range(steps):
            if self.py.random() < p_turn:
                direction = self.py.sample(directions, 1)[0]
            pos = pos + direction
            pos[0], pos[1] = max(min(pos[0], rows - 2), 1), max(min(pos[1], cols - 2), 1)
            mask = self.py.sample(_MASKS, 1)[0]
            level[pos[0] - 1:pos[0] + 2, pos[1] - 1:pos[1] + 2] += mask
        level[level > 0] = 1
        level[:, [0, cols - 1]] = 0
        level[[0, rows - 1], :] = 0
        return level

    def place(self, room: np.ndarray, num_boxes: int) -> np.ndarray:
        free = np.where(room == 1)
        if free[0].shape[0] <= num_boxes + 1:
            raise RuntimeError("not enough floor for the player and the boxes")
        i = self.np.randint(free[0].shape[0])
        room[free[0][i], free[1][i]] = PLAYER
        for _ in range(num_boxes):
            free = np.where(room == 1)
            i = self.np.randint(free[0].shape[0])
            room[free[0][i], free[1][i]] = TARGET
        return room

    def reverse_play(self, state: np.ndarray, fixed: np.ndarray, depth: int) -> tuple[np.ndarray, dict]:
        """The state, reached by pulling boxes off their targets, whose (box moves x displacement) is largest."""
        targets = list(zip(*np.where(fixed == TARGET)))
        best = {"score": -1, "room": None, "mapping": {t: t for t in targets}}
        explored: set[bytes] = set()

        def search(room, mapping, swaps, last_pull, ttl):
            ttl -= 1
            if ttl <= 0 or len(explored) >= 300000:
                return
            key = room.tobytes()
            if key in explored:
                return
            score = swaps * displacement(mapping)
            if np.where(room == TARGET)[0].shape[0] != len(targets):
                score = 0
            if score > best["score"]:
                best.update(score=score, room=room.copy(), mapping=dict(mapping))
            explored.add(key)
            for action in range(4):
                nxt, nxt_map = room.copy(), dict(mapping)
                pull = _pull(nxt, fixed, nxt_map, last_pull, action)
                search(nxt, nxt_map, swaps + (pull != last_pull), pull, ttl)

        search(state, best["mapping"], 0, (-1, -1), depth)
        return best["room"], best["mapping"]

    def wander(self, state: np.ndarray, fixed: np.ndarray, p_move: float) -> np.ndarray:
        if self.py.random() > p_move:
            return state
        pos = np.argwhere(state == PLAYER)[0]
        visited = [tuple(pos)]
        for taken in range(1, 4):
            moves = [(a, pos + _STEP[a]) for a in range(4)
                     if state[tuple(pos + _STEP[a])] in (FLOOR, TARGET) and tuple(pos + _STEP[a]) not in visited]
            if not moves:
                break
            _, nxt = self.py.choice(moves)
            state[tuple(pos)], state[tuple(nxt)] = fixed[tuple(pos)], PLAYER
            pos = nxt
            visited.append(tuple(pos))
            if taken >= 3 or self.py.random() > 0.5:
                break
        return state

    def room(self, dim: tuple[int, int], num_boxes: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
        steps = int(1.7 * (dim[0] + dim[1]))
        for _ in range(4):
            room = self.place(self.topology(dim, steps), num_boxes)
            fixed = room.copy()
            fixed[fixed == PLAYER] = FLOOR
            state = room.copy()
            state[state == TARGET] = BOX  # the boxes start on their targets
            state, mapping = self.reverse_play(state, fixed, depth)
            state[state == BOX_ON_TARGET] = BOX
            if displacement(mapping) > 0:
                break
        if displacement(mapping) == 0:
            raise RuntimeError("no box could be moved off its target")
        return fixed, self.wander(state, fixed, 0.8 if displacement(mapping) == 1 else 0.5)


def displacement(mapping: dict) -> int:
    """The summed Manhattan distance of every box from its target."""
    return int(sum(abs(a[0] - b[0]) + abs(a[1] - b[1]) for a, b in mapping.items()))


def _pull(room: np.ndarray, fixed: np.ndarray, mapping: dict, last_pull: tuple, action: int) -> tuple:
    """A backwards move: the player steps away, pulling the box behind it (gym-sokoban's reverse_move)."""
    pos = np.argwhere(room == PLAYER)[0]
    nxt = pos + _STEP[action]
    if room[tuple(nxt)] in (FLOOR, TARGET):
        room[tuple(pos)], room[tuple(nxt)] = fixed[tuple(pos)], PLAYER
        behind = tuple(pos - _STEP[action])
        if room[behind] in (BOX_ON_TARGET, BOX):
            room[tuple(pos)], room[behind] = BOX_ON_TARGET, fixed[behind]
            for target, at in mapping.items():
                if at == behind:
                    mapping[target] = tuple(int(i) for i in pos)
                    last_pull = target
    return last_pull


def make_room(seed: int, dim: tuple[int, int], num_boxes: int, depth: int, tries: int = 100) -> tuple:
    """(fixed, state) of the episode ``seed``: walls/floor/targets, and the boxes and player on them."""
    for k in range(tries):
        try:
            return _Rooms(seed + k).room(dim, num_boxes, depth)
        except RuntimeError:
            continue
    raise ValueError(f"sokoban: no room of {dim} with {num_boxes} boxes after {tries} seeds from {seed}")


@register_environment("sokoban")
class Sokoban(TextGame):
    DEFAULTS = {"dim_room": (10, 10), "num_boxes": 4, "search_depth": 300, "max_steps": 20}
    INSTRUCTION = ("You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
                   "When you are right next to a box, you can push it by moving in the same direction. You cannot "
                   "push a box through a wall, and you cannot pull a box. The answer must be one of action in a turn, "
                   "format is <answer>Right</answer>.")
    GRID_VOCAB = {"#": "wall", "_": "empty", "O": "target", "√": "box on target", "X": "box", "P": "player",
                  "S": "player on target"}
    ACTIONS = {1: "Up", 2: "Down", 3: "Left", 4: "Right"}

    def new_board(self, seed: int) -> None:
        self.grid = lookup(self.cfg.get("grid_lookup"), _GRID)
        dim = tuple(int(d) for d in self.cfg["dim_room"])
        self.fixed, self.state = make_room(seed, dim, int(self.cfg["num_boxes"]), int(self.cfg["search_depth"]))
        self.set_board(self.fixed, self.state)

    def set_board(self, fixed: np.ndarray, state: np.ndarray) -> None:
        """Play from a given room (``fixed``: walls 0, floor 1, targets 2; ``state``: with boxes 3/4, player 5)."""
        self.fixed, self.state = np.asarray(fixed, int).copy(), np.asarray(state, int).copy()
        self.num_boxes = int(np.sum((self.state == BOX) | (self.state == BOX_ON_TARGET)))
        self.on_target, self.game_steps = self._on_target(), 0

    def _on_target(self) -> int:
        uncovered = (self.state == TARGET) | ((self.fixed == TARGET) & (self.state == PLAYER))
        return self.num_boxes - int(np.sum(uncovered))

    def move(self, action: Any) -> tuple[float, bool, bool]:
        self.game_steps += 1
        moved = False
        if action is not None:
            step = np.array(_STEP[(int(action) - 1) % 4])
            pos = np.argwhere(self.state == PLAYER)[0]
            nxt, beyond = pos + step, pos + 2 * step
            inside = all(0 <= beyond[i] < self.state.shape[i] for i in range(2))
            if inside and self.state[tuple(nxt)] in (BOX, BOX_ON_TARGET) and self.state[tuple(beyond)] in (FLOOR,
                                                                                                             TARGET):
                self.state[tuple(beyond)] = BOX_ON_TARGET if self.fixed[tuple(beyond)] == TARGET else BOX
                moved = True
            elif self.state[tuple(nxt)] in (FLOOR, TARGET):
                moved = True
            if moved:
                self.state[tuple(pos)], self.state[tuple(nxt)] = self.fixed[tuple(pos)], PLAYER
        reward = -0.1
        now = self._on_target()
        reward += 1.0 if now > self.on_target else -1.0 if now < self.on_target else 0.0
        self.on_target = now
        self.success = now == self.num_boxes
        if self.success:
            reward += 10.0
        return reward, self.success or self.game_steps >= self.game_max_steps, moved

    def render(self) -> str:
        shown = np.where((self.state == PLAYER) & (self.fixed == TARGET), PLAYER_ON_TARGET, self.state)
        return "\n".join("".join(self.grid.get(int(v), "?") for v in row) for row in shown)


# ROLL's tags for Sokoban (examples/config/traj_envs.yaml).
@register_environment("SimpleSokoban")
class SimpleSokoban(Sokoban):
    DEFAULTS = {**Sokoban.DEFAULTS, "dim_room": (6, 6), "num_boxes": 1, "max_steps": 10}


@register_environment("LargerSokoban")
class LargerSokoban(Sokoban):
    DEFAULTS = {**Sokoban.DEFAULTS, "dim_room": (10, 10), "num_boxes": 2, "search_depth": 10, "max_steps": 10}


@register_environment("SokobanDifferentGridVocab")
class SokobanDifferentGridVocab(Sokoban):
    DEFAULTS = {**Sokoban.DEFAULTS, "dim_room": (6, 6), "num_boxes": 1, "search_depth": 30, "max_steps": 10}
    GRID_VOCAB = {"W": "wall", ".": "empty", "G": "target", "C": "box on target", "B": "box", "A": "player",
                  "@": "player on target"}
    GRID = {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"}

    def new_board(self, seed: int) -> None:
        self.cfg.setdefault("grid_lookup", self.GRID)
        super().new_board(seed)
