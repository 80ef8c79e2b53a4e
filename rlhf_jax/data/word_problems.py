"""Templates of grade-school arithmetic word problems (``synthetic.make_word_problems`` draws from them).

Each problem is one or two steps of whole-number arithmetic in a short story
("Mia has 12 stickers. She buys 3 packs with 5 stickers in each. How many
stickers does she have now?"). Rows follow verl's preprocessed GSM8K schema:
``data_source`` ``"word_problems"`` (graded by the GSM8K scorer in its flexible mode: the
last number of the response is its answer, whether after ``####`` or not), the
question plus verl's GSM8K instruction (``Let's think step by step and output the
final answer after "####".``) as the user message, the integer answer as
``reward_model.ground_truth``, and in ``extra_info`` the worked solution written as
GSM8K writes it (``12 + 3 * 5 = 27\\n#### 27``), the template and the split.

Splits are disjoint by construction: a problem belongs to the held-out splits
(anything but ``train``) iff the CRC-32 of its question is divisible by 5, so no
validation question is ever trained on, whatever the seeds and sizes.

Every answer is a non-negative integer (divisions are exact, subtractions stay >= 0).
``max_steps`` (1 or 2) caps the number of operations; ``max_value`` the size of the
numbers in the story; ``instruction`` picks the sentence after the question (:data:`INSTRUCTIONS`). Deterministic: the same (n, seed, knobs) give the same rows.
"""

from __future__ import annotations

import random
import zlib
from typing import Callable

# The sentence appended to each question (knob ``instruction``): verl's GSM8K sentence, or a
# request for the bare answer (short responses: a GRPO step costs about its response length).
INSTRUCTIONS = {
    "gsm8k": 'Let\'s think step by step and output the final answer after "####".',
    "answer_only": "Answer with just the final number.",
}
INSTRUCTION = INSTRUCTIONS["gsm8k"]
NAMES = ("Mia", "Noah", "Ava", "Liam", "Emma", "Omar", "Sofia", "Ravi", "Lena", "Kenji", "Zoe", "Diego")
PRONOUN = {"Mia": "she", "Ava": "she", "Emma": "she", "Sofia": "she", "Lena": "she", "Zoe": "she"}
ITEMS = ("apples", "stickers", "marbles", "pencils", "cookies", "books", "shells", "cards", "stamps", "eggs")

# A template draws its numbers from rng (each at most max_value) and returns (question, solution, answer).
Template = Callable[[random.Random, int, str, str, str], tuple[str, str, int]]


def _num(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, max(lo, hi))


def _buy_more(rng, m, name, he, item):
    a, b = _num(rng, 2, m), _num(rng, 2, m)
    return (f"{name} has {a} {item}. {he.capitalize()} buys {b} more. How many {item} does {name} have now?",
            f"{a} + {b} = {a + b}", a + b)


def _give_away(rng, m, name, he, item):
    a = _num(rng, 3, m)
    b = _num(rng, 1, a - 1)
    return (f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} does {name} have left?",
            f"{a} - {b} = {a - b}", a - b)


def _packs(rng, m, name, he, item):
    a, b = _num(rng, 2, min(m, 12)), _num(rng, 2, min(m, 12))
    return (f"{name} buys {a} packs of {item}. Each pack holds {b} {item}. How many {item} does {name} buy?",
            f"{a} * {b} = {a * b}", a * b)


def _share(rng, m, name, he, item):
    k, b = _num(rng, 2, min(m, 12)), _num(rng, 2, min(m, 9))
    return (f"{name} shares {k * b} {item} equally among {b} friends. How many {item} does each friend get?",
            f"{k * b} / {b} = {k}", k)


def _buy_packs(rng, m, name, he, item):
    a, b, c = _num(rng, 2, m), _num(rng, 2, min(m, 9)), _num(rng, 2, min(m, 9))
    return (f"{name} has {a} {item}. {he.capitalize()} buys {b} packs with {c} {item} in each. "
            f"How many {item} does {name} have now?", f"{a} + {b} * {c} = {a} + {b * c} = {a + b * c}", a + b * c)


def _sell_twice(rng, m, name, he, item):
    a = _num(rng, 6, 2 * m)
    b = _num(rng, 1, a // 2)
    c = _num(rng, 1, a - b)
    return (f"A shop has {a} {item}. It sells {b} in the morning and {c} in the afternoon. "
            f"How many {item} are left?", f"{a} - {b} - {c} = {a - b} - {c} = {a - b - c}", a - b - c)


def _wage(rng, m, name, he, item):
    a, b = _num(rng, 5, min(m, 20)), _num(rng, 2, 8)
    c = _num(rng, 1, a * b)
    return (f"{name} earns {a} dollars per hour and works {b} hours. Then {he} spends {c} dollars. "
            f"How many dollars does {name} have left?", f"{a} * {b} - {c} = {a * b} - {c} = {a * b - c}", a * b - c)


def _two_friends(rng, m, name, he, item):
    a, b = _num(rng, 2, m), _num(rng, 2, 5)
    friend = rng.choice([n for n in NAMES if n != name])
    return (f"{name} has {a} {item}. {friend} has {b} times as many {item} as {name}. "
            f"How many {item} do they have together?", f"{a} + {a} * {b} = {a} + {a * b} = {a + a * b}", a + a * b)


ONE_STEP: tuple[Template, ...] = (_buy_more, _give_away, _packs, _share)
TWO_STEP: tuple[Template, ...] = (_buy_packs, _sell_twice, _wage, _two_friends)


def templates(max_steps: int) -> tuple[Template, ...]:
    if max_steps not in (1, 2):
        raise ValueError(f"word_problems: max_steps must be 1 or 2, got {max_steps}")
    return ONE_STEP + (TWO_STEP if max_steps == 2 else ())


def in_split(question: str, split: str) -> bool:
    """Whether ``question`` belongs to ``split``: held out (any split but train) iff its CRC-32 is divisible by 5."""
    return (zlib.crc32(question.encode()) % 5 == 0) == (split != "train")
