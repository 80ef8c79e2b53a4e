"""Loading the scoring function: a user's file (``custom_reward_function.path/.name``) or the built-ins.

A custom function is called as ``compute_score(data_source, solution_str,
ground_truth, extra_info)`` and returns a number or a dict with a ``score`` key
plus extra metrics (numbers; other values are ignored). ``ScoreSpec`` describes
the function in a picklable way, so that worker processes can load it themselves.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from rlhf_jax.rewards.registry import default_compute_score

ComputeScore = Callable[[str, str, Any, dict], Any]


class RewardLoadError(ValueError):
    """The custom reward file cannot be loaded: a one-line message naming the file, line and key."""


def _top_level_names(body: list[ast.stmt]) -> set[str] | None:
    """Names a module body binds (descending into if/try/with blocks); None after ``from x import *``."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        for block in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, block, None)
            if inner and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stmts = [s for h in inner for s in h.body] if block == "handlers" else inner
                found = _top_level_names(stmts)
                if found is None:
                    return None
                names |= found
    return names


def check_reward_file(path: str, name: str = "compute_score") -> None:
    """Fail with one line when ``path`` is missing, does not parse, or defines no ``name``, without running it."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except FileNotFoundError:
        raise RewardLoadError(f"custom_reward_function.path: file not found: {path}") from None
    except OSError as e:
        raise RewardLoadError(f"custom_reward_function.path: cannot read {path}: {e.strerror}") from None
    except (SyntaxError, ValueError) as e:  # ValueError: null bytes
        line = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise RewardLoadError(f"custom_reward_function.path: {path}{line}: {type(e).__name__}: "
                              f"{getattr(e, 'msg', None) or e}") from None
    names = _top_level_names(tree.body)
    if names is not None and name not in names:
        raise RewardLoadError(f"custom_reward_function.name: {path} defines no function named {name!r}")


def _line_in(error: BaseException, path: str) -> str:
    """' line N' of the deepest frame of ``error``'s traceback that is in ``path``."""
    line = ""
    tb = error.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == path:
            line = f" line {tb.tb_lineno}"
        tb = tb.tb_next
    return line


def import_user_file(path: str, key: str, error: type[Exception] = RewardLoadError,
                     missing: type[Exception] = FileNotFoundError):
    """(absolute path, module) of a user's Python file, imported once per process. A missing file raises
    ``missing``, an import that fails ``error``: one line naming ``key``, the file and line, and the exception."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise missing(f"{key}: file not found: {path}")
    module_name = "rlhf_jax_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise error(f"{key}: cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as e:  # noqa: BLE001 - whatever the user's module does on import (even sys.exit)
            del sys.modules[module_name]
            message = str(e).splitlines()[0] if str(e) else ""
            raise error(f"{key}: {path}{_line_in(e, path)}: {type(e).__name__}: {message}") from None
    return path, module


def load_function_from_file(path: str, name: str = "compute_score") -> ComputeScore:
    """Import `path` as a module (once per path) and return its attribute `name`."""
    path, module = import_user_file(path, "custom_reward_function.path")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardLoadError(f"custom_reward_function.name: {path} has no function named {name!r}")
    return fn


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """Which scoring function to use: a file + name, a picklable callable, or the built-in scorers."""

    path: str | None = None
    name: str = "compute_score"
    fn: ComputeScore | None = None
    scorer_kwargs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def load(self) -> ComputeScore:
        if self.fn is not None:
            return self.fn
        if self.path:
            return load_function_from_file(self.path, self.name)
        kwargs = {k: dict(v) for k, v in self.scorer_kwargs.items()}
        return functools.partial(_builtin, scorer_kwargs=kwargs)


def _builtin(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any, *, scorer_kwargs: Any) -> float:
    return default_compute_score(data_source, solution_str, ground_truth, extra_info, scorer_kwargs)


def normalize_result(result: Any) -> tuple[float, dict[str, float]]:
    """(score, numeric extra metrics) from a float or {'score': ..., **metrics}; raises on anything else."""
    extras: dict[str, float] = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"reward function returned a dict without a 'score' key: keys {sorted(result)}")
        for key, value in result.items():
            if key == "score":
                continue
            try:
                extras[str(key)] = float(value)
            except (TypeError, ValueError):
                continue
        result = result["score"]
    try:
        score = float(result)
    except (TypeError, ValueError):
        raise TypeError(f"reward function must return a number or a dict with 'score', got {type(result).__name__}") \
            from None
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    return score, extras


def spec_from_config(custom_cfg: Any, reward_cfg: Any) -> ScoreSpec:
    """ScoreSpec from a finalized config's `custom_reward_function` (path, name) and `reward_model` (scorer_kwargs,
    answer_match)."""
    kwargs = {k: dict(v) for k, v in dict(reward_cfg.scorer_kwargs or {}).items()}  # None = every scorer's defaults
    kwargs.setdefault("answer_match", {}).setdefault("mode", reward_cfg.answer_match)
    return ScoreSpec(path=custom_cfg.path or None, name=custom_cfg.name, scorer_kwargs=kwargs)
