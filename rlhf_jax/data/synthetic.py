"""Synthetic tasks that need no download: arithmetic and countdown, as verl-schema parquet.

Rows follow verl's preprocessed schema: ``data_source``, ``prompt`` (a list of chat
messages), ``ability``, ``reward_model`` (``{"style": "rule", "ground_truth": ...}``)
and ``extra_info`` (split, index, and the expression / a reference solution).
Generation is deterministic from the seed.

- arithmetic: ``num_terms`` integers in [min_value, max_value] joined by operators
  drawn from ``ops`` (+ - *, usual precedence); ground truth is the integer value
  as a string. ``style="bare"`` prompts are just ``"3+4="`` (for tiny models),
  ``style="instruct"`` asks for the answer after ``####``.
- word_problems: grade-school word problems in GSM8K's format, see
  :mod:`rlhf_jax.data.word_problems`.
- arithmetic_preferences: the arithmetic rows with ``chosen`` (the right value) and ``rejected`` (a wrong
  one) responses, DPO's preference pairs.
- calculator_demos: the arithmetic rows (default: 3-digit times 2-digit products) plus a ``messages`` conversation
  that demonstrates the calculator tool: the assistant writes a Hermes ``<tool_call>``, the ``tool`` message
  holds the result, the assistant answers ``#### <value>`` (multi-turn SFT data; the same rows' ``prompt`` and
  ground truth serve RL).
- countdown: ``num_numbers`` integers in [1, max_number] and a target in
  [1, max_target] that is reachable using each number exactly once with ``ops``;
  ground truth ``{"target": int, "numbers": [...]}``, answer in ``<answer>`` tags.

CLI: ``python -m rlhf_jax.data.synthetic --task arithmetic --out DIR`` writes
``DIR/train.parquet`` and ``DIR/test.parquet``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from fractions import Fraction
from typing import Any

from rlhf_jax.config.names import BUILTIN_DATASETS
from rlhf_jax.data import word_problems
from rlhf_jax.rewards.expression import evaluate

ARITHMETIC_OPS = ("+", "-", "*")
COUNTDOWN_OPS = ("+", "-", "*", "/")


def _check_ops(ops: str | tuple[str, ...], allowed: tuple[str, ...], task: str) -> tuple[str, ...]:
    ops = tuple(ops)
    bad = [o for o in ops if o not in allowed]
    if not ops or bad:
        raise ValueError(f"{task}: ops must be a non-empty subset of {allowed}, got {ops}")
    return ops


def _row(data_source: str, ability: str, content: str, ground_truth: Any, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra,
    }


def make_arithmetic(
    n: int,
    seed: int = 0,
    *,
    min_value: int = 0,
    max_value: int = 9,
    num_terms: int = 2,
    ops: str | tuple[str, ...] = ("+",),
    style: str = "bare",
    split: str = "train",
) -> list[dict[str, Any]]:
    """`n` arithmetic rows; difficulty from the operand range, number of terms and operators."""
    ops = _check_ops(ops, ARITHMETIC_OPS, "arithmetic")
    if num_terms < 2 or min_value > max_value:
        raise ValueError(f"arithmetic: need num_terms >= 2 and min_value <= max_value, got {num_terms}, "
                         f"[{min_value}, {max_value}]")
    if style not in ("bare", "instruct"):
        raise ValueError(f"arithmetic: style must be 'bare' or 'instruct', got {style!r}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        terms = [rng.randint(min_value, max_value) for _ in range(num_terms)]
        chosen = [rng.choice(ops) for _ in range(num_terms - 1)]
        expr = str(terms[0]) + "".join(f"{op}{t}" for op, t in zip(chosen, terms[1:]))
        if any(t < 0 for t in terms):  # parenthesise negative operands so the text parses unambiguously
            expr = f"({terms[0]})" + "".join(f"{op}({t})" for op, t in zip(chosen, terms[1:]))
        value, _ = evaluate(expr.replace("(-", "(0-"))
        answer = str(int(value))
        if style == "bare":
            content = f"{expr}="
        else:
            content = f"Compute {expr}. Give the final answer as an integer after \"####\"."
        rows.append(_row("arithmetic", "math", content, answer, {"split": split, "index": i, "expression": expr}))
    return rows


def _countdown_instance(rng: random.Random, numbers: list[int], ops: tuple[str, ...]) -> tuple[Fraction, str]:
    items: list[tuple[Fraction, str]] = [(Fraction(x), str(x)) for x in numbers]
    while len(items) > 1:
        a, b = (items.pop(rng.randrange(len(items))) for _ in range(2))
        op = rng.choice(ops)
        if op == "-" and a[0] < b[0]:
            a, b = b, a
        if op == "/" and (b[0] == 0 or (a[0] / b[0]).denominator != 1):
            op = "+"
        value = {"+": a[0] + b[0], "-": a[0] - b[0], "*": a[0] * b[0], "/": a[0] / b[0] if b[0] else None}[op]
        items.append((value, f"({a[1]} {op} {b[1]})"))
    value, text = items[0]
    return value, text[1:-1] if text.startswith("(") else text


def make_countdown(
    n: int,
    seed: int = 0,
    *,
    num_numbers: int = 3,
    max_number: int = 20,
    max_target: int = 100,
    ops: str | tuple[str, ...] = COUNTDOWN_OPS,
    split: str = "train",
) -> list[dict[str, Any]]:
    """`n` countdown rows, each with a reachable target (a reference solution is kept in extra_info)."""
    ops = _check_ops(ops, COUNTDOWN_OPS, "countdown")
    if num_numbers < 2 or max_number < 1 or max_target < 1:
        raise ValueError("countdown: need num_numbers >= 2, max_number >= 1, max_target >= 1")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        for _ in range(1000):
            numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
            value, solution = _countdown_instance(rng, numbers, ops)
            if value.denominator == 1 and 1 <= value <= max_target:
                break
        else:
            raise ValueError(f"countdown: no target in [1, {max_target}] found for these settings; raise max_target")
        target = int(value)
        content = (
            f"Using the numbers {numbers}, create an equation that equals {target}. You can use "
            f"{' '.join(ops)} and parentheses, and each number exactly once. Show your work, then give the "
            "equation in <answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>."
        )
        gt = {"target": target, "numbers": numbers}
        rows.append(_row("countdown", "math", content, gt, {"split": split, "index": i, "solution": solution}))
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str) -> str:
    """Write rows as parquet (nested columns become structs / lists)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def make_word_problems(n: int, seed: int = 0, *, max_steps: int = 2, max_value: int = 50,
                       instruction: str = "gsm8k", split: str = "train") -> list[dict[str, Any]]:
    """``n`` distinct word problems of ``split`` (see :mod:`rlhf_jax.data.word_problems`)."""
    templates = word_problems.templates(max_steps)
    if instruction not in word_problems.INSTRUCTIONS:
        raise ValueError(f"word_problems: instruction must be one of {sorted(word_problems.INSTRUCTIONS)}, "
                         f"got {instruction!r}")
    sentence = word_problems.INSTRUCTIONS[instruction]
    if max_value < 5:
        raise ValueError(f"word_problems: max_value must be >= 5, got {max_value}")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    misses = 0  # draws in a row that gave nothing new: the pool is exhausted well before this many
    while len(rows) < n and misses < 20000:
        template = rng.choice(templates)
        name, item = rng.choice(word_problems.NAMES), rng.choice(word_problems.ITEMS)
        question, work, answer = template(rng, max_value, name, word_problems.PRONOUN.get(name, "he"), item)
        if not word_problems.in_split(question, split) or question in seen:
            misses += 1
            continue
        misses = 0
        seen.add(question)
        rows.append(_row("word_problems", "math", f"{question} {sentence}", str(answer),
                         {"split": split, "index": len(rows), "question": question,
                          "answer": f"{work}\n#### {answer}", "template": template.__name__.lstrip("_")}))
    if len(rows) < n:
        raise ValueError(f"word_problems: only {len(rows)} distinct {split} problems with max_value={max_value} "
                         f"and max_steps={max_steps}; ask for fewer or raise max_value")
    return rows


def make_arithmetic_preferences(n: int, seed: int = 0, *, max_offset: int = 3, split: str = "train",
                                **knobs: Any) -> list[dict[str, Any]]:
    """Arithmetic rows (``knobs`` as :func:`make_arithmetic`) as DPO preference pairs: ``chosen`` is the right
    value, ``rejected`` a wrong one (the right value moved by 1..``max_offset`` either way, never below 0)."""
    if max_offset < 1:
        raise ValueError(f"arithmetic_preferences: max_offset must be >= 1, got {max_offset}")
    rows = make_arithmetic(n, seed, split=split, **knobs)
    rng = random.Random(seed + 7919)  # another stream than the expressions'
    for row in rows:
        value = int(row["reward_model"]["ground_truth"])
        wrong = [value + d for d in range(-max_offset, max_offset + 1) if d and value + d >= 0]
        row.update(data_source="arithmetic_preferences", chosen=str(value), rejected=str(rng.choice(wrong)))
    return rows


def calculator_call(expression: str) -> str:
    """The Hermes tool-call text of one calculator call (what the multi-turn parser reads back)."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def make_calculator_demos(n: int, seed: int = 0, *, min_value: int = 100, max_value: int = 999,
                          min_factor: int = 10, max_factor: int = 99, ops: str | tuple[str, ...] = ("*",),
                          split: str = "train") -> list[dict[str, Any]]:
    """`n` problems ``a<op>b=`` (a in [min_value, max_value], b in [min_factor, max_factor]) with a demonstration
    conversation: user asks, assistant calls the calculator, the tool answers, assistant gives ``#### value``."""
    ops = _check_ops(ops, ARITHMETIC_OPS, "calculator_demos")
    if min_value > max_value or min_factor > max_factor or min(min_value, min_factor) < 0:
        raise ValueError(f"calculator_demos: need 0 <= min_value <= max_value and 0 <= min_factor <= max_factor, got "
                         f"[{min_value}, {max_value}], [{min_factor}, {max_factor}]")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        expr = f"{rng.randint(min_value, max_value)}{rng.choice(ops)}{rng.randint(min_factor, max_factor)}"
        value = str(int(evaluate(expr)[0]))
        row = _row("calculator_demos", "math", f"{expr}=", value, {"split": split, "index": i, "expression": expr})
        row["data_source"] = "arithmetic"  # scored by the arithmetic scorer
        row["messages"] = [{"role": "user", "content": f"{expr}="},
                           {"role": "assistant", "content": calculator_call(expr)},
                           {"role": "tool", "name": "calculator", "content": value},
                           {"role": "assistant", "content": f"#### {value}"}]
        rows.append(row)
    return rows


def make_guess_number(n: int, seed: int = 0, *, max_value: int = 100, max_steps: int = 8,
                      split: str = "train") -> list[dict[str, Any]]:
    """`n` tasks of the ``guess_number`` environment (agents/environment.py): a secret in [1, max_value] as the
    ground truth, ``max_steps`` guesses; the prompt is the environment's (this row's text only describes it)."""
    if max_value < 1 or max_steps < 1:
        raise ValueError(f"guess_number: need max_value >= 1 and max_steps >= 1, got {max_value}, {max_steps}")
    rng = random.Random(seed)
    return [_row("guess_number", "game", f"Guess an integer between 1 and {max_value}.", rng.randint(1, max_value),
                 {"split": split, "index": i, "low": 1, "high": max_value, "max_moves": max_steps})
            for i in range(n)]


def make_env_tasks(n: int, seed: int = 0, *, env: str = "", split: str = "train") -> list[dict[str, Any]]:
    """`n` episodes of the environment named ``env`` (``multi_turn.environments``' name, e.g. ROLL's tag
    ``SimpleSokoban``), each with its own seed in ``extra_info`` (the board comes from the environment and the seed;
    the row's prompt only names the game)."""
    if not env:
        raise ValueError("env_tasks: name the environment, e.g. builtin:env_tasks?env=FrozenLake")
    rng = random.Random(f"{env}:{seed}")  # each environment its own seeds
    return [_row("env_tasks", "game", env, "", {"split": split, "index": i, "env": env,
                                                 "seed": rng.randrange(2**31)}) for i in range(n)]


GENERATORS = {"arithmetic": make_arithmetic, "countdown": make_countdown, "word_problems": make_word_problems,
              "arithmetic_preferences": make_arithmetic_preferences, "guess_number": make_guess_number,
              "calculator_demos": make_calculator_demos, "env_tasks": make_env_tasks}
if tuple(GENERATORS) != BUILTIN_DATASETS:  # the names the config accepts as builtin:<name>
    raise RuntimeError(f"rlhf_jax.config.names.BUILTIN_DATASETS {BUILTIN_DATASETS} != the generators {tuple(GENERATORS)}")


def generate(task: str, out_dir: str, *, train_size: int, test_size: int, seed: int, **knobs: Any) -> list[str]:
    """Write DIR/train.parquet and DIR/test.parquet for `task` (test uses seed + 1)."""
    if task not in GENERATORS:
        raise ValueError(f"task must be one of {sorted(GENERATORS)}, got {task!r}")
    paths = []
    for split, size, s in (("train", train_size, seed), ("test", test_size, seed + 1)):
        rows = GENERATORS[task](size, s, split=split, **knobs)
        paths.append(write_parquet(rows, os.path.join(out_dir, f"{split}.parquet")))
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True, choices=sorted(GENERATORS))
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--train-size", type=int, default=1000)
    p.add_argument("--test-size", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", default=None, help="operators, e.g. '+-*' (arithmetic default '+', countdown '+-*/')")
    p.add_argument("--min-value", type=int, default=0, help="arithmetic: smallest operand")
    p.add_argument("--max-value", type=int, default=None,
                   help="arithmetic: largest operand (default 9); word_problems: largest story number (default 50)")
    p.add_argument("--num-terms", type=int, default=2, help="arithmetic: operands per expression")
    p.add_argument("--style", default="bare", choices=["bare", "instruct"], help="arithmetic prompt style")
    p.add_argument("--max-steps", type=int, default=2, help="word_problems: operations per problem (1 or 2)")
    p.add_argument("--num-numbers", type=int, default=3, help="countdown: numbers given")
    p.add_argument("--max-number", type=int, default=20, help="countdown: largest given number")
    p.add_argument("--max-target", type=int, default=100, help="countdown: largest target")
    a = p.parse_args(argv)
    if a.task in ("arithmetic", "arithmetic_preferences"):
        knobs = dict(min_value=a.min_value, max_value=9 if a.max_value is None else a.max_value, num_terms=a.num_terms,
                     ops=tuple(a.ops or "+"), style=a.style)
    elif a.task == "word_problems":
        knobs = dict(max_steps=a.max_steps, max_value=50 if a.max_value is None else a.max_value)
    else:
        knobs = dict(num_numbers=a.num_numbers, max_number=a.max_number, max_target=a.max_target,
                     ops=tuple(a.ops or "+-*/"))
    for path in generate(a.task, a.out, train_size=a.train_size, test_size=a.test_size, seed=a.seed, **knobs):
        print(path)


if __name__ == "__main__":
    main()
