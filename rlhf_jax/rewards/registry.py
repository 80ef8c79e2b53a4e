"""Rule-based scorers chosen by a row's ``data_source``, as verl does.

``data_source`` is matched exactly, then lower-cased, then by its last path
component (``openai/gsm8k`` -> ``gsm8k``, ``lighteval/MATH`` -> ``math``).
Built-ins: gsm8k, word_problems (GSM8K's flexible mode), math, arithmetic, countdown, code (verl's code data
sources: the answer's program runs in a sandbox against test cases), and answer_match,
which also scores every data_source that has no scorer of its own. Add your own with
``@register_scorer("name", aliases=(...))``; a scorer is called as
``fn(solution_str, ground_truth, **kwargs)`` (plus ``extra_info=`` when its
signature has that parameter), where kwargs come from
``reward_model.scorer_kwargs.<name>``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from rlhf_jax.rewards import answer_match, arithmetic, code_exec, countdown, gsm8k, math_boxed

ScoreFn = Callable[..., float]

_SCORERS: dict[str, ScoreFn] = {}
_ALIASES: dict[str, str] = {}
_WANTS_EXTRA: dict[str, bool] = {}


def register_scorer(name: str, aliases: tuple[str, ...] = ()) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator: register `fn` as the scorer for data_source `name` (and `aliases`)."""

    def deco(fn: ScoreFn) -> ScoreFn:
        _SCORERS[name] = fn
        _WANTS_EXTRA[name] = "extra_info" in inspect.signature(fn).parameters
        for alias in (name, *aliases):
            _ALIASES[alias] = name
            _ALIASES[alias.lower()] = name
        return fn

    return deco


register_scorer("gsm8k", aliases=("openai/gsm8k",))(gsm8k.compute_score)
register_scorer("word_problems")(gsm8k.compute_flexible_score)
register_scorer(
    "math",
    aliases=("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math-500",
             "math-lighteval", "hendrycks_math", "competition_math"),
)(math_boxed.compute_score)
register_scorer("arithmetic")(arithmetic.compute_score)
register_scorer("countdown", aliases=("countdown-tasks-3to4",))(countdown.compute_score)
register_scorer("answer_match")(answer_match.compute_score)
register_scorer("code", aliases=code_exec.DATA_SOURCES)(code_exec.compute_score)
FALLBACK_SCORER = "answer_match"


def scorer_name(data_source: str) -> str | None:
    """The registered scorer name for a data_source, or None."""
    for key in (data_source, data_source.lower(), data_source.rsplit("/", 1)[-1].lower()):
        if key in _ALIASES:
            return _ALIASES[key]
    return None


def known_scorers() -> list[str]:
    return sorted(_SCORERS)


def check_data_sources(data_sources: set[str] | list[str]) -> None:
    """Fail before training when some data_source has no built-in scorer."""
    missing = sorted({d for d in data_sources if scorer_name(d) is None})
    if missing:
        raise KeyError(
            f"no built-in reward for data_source {missing}; known: {known_scorers()} (and their aliases). "
            "Set custom_reward_function.path, use a reward model, or register one with @register_scorer"
        )


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    scorer_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> float:
    """Score one response with the built-in scorer for its data_source (answer_match for unknown ones)."""
    name = scorer_name(data_source) or FALLBACK_SCORER
    kwargs = dict((scorer_kwargs or {}).get(name, {}) or {})
    if _WANTS_EXTRA[name]:
        kwargs["extra_info"] = extra_info
    return float(_SCORERS[name](solution_str, ground_truth, **kwargs))
