r"""MATH-style scorer: compare the last ``\boxed{...}`` with the ground truth after normalisation.

The answer is the content of the last ``\boxed{...}`` or ``\fbox{...}`` (braces
matched, so nested ``\frac{1}{2}`` survives), or the token after ``\boxed `` in
the space form. Both answer and ground truth (which may itself contain a
``\boxed{}``) are normalised the way the MATH benchmark does: ``\left``/``\right``,
spaces, ``\!``, ``$``, degrees, ``%`` and trailing ``\text{ units}`` are removed;
``\dfrac``/``\tfrac`` become ``\frac``; ``\frac12`` -> ``\frac{1}{2}``,
``\sqrt3`` -> ``\sqrt{3}``, ``3/4`` -> ``\frac{3}{4}``, ``.5`` -> ``0.5``,
``0.5`` -> ``\frac{1}{2}``; a short ``x =`` prefix is dropped; plain numbers are
compared by value (``1,000`` = ``1000.0``). Score 1.0 on equality, else 0.0.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any


def last_boxed_content(text: str) -> str | None:
    r"""Content of the last \boxed{...} / \fbox{...} (or '\boxed x' space form), None if absent or unbalanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    head = "\\boxed" if rest.startswith("\\boxed") else "\\fbox"
    after = rest[len(head):]
    if after.startswith(" "):
        return after.strip().split("$")[0].strip() or None
    if not after.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(after):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return after[1:i]
    return None


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, tail = part[0], part[1], part[2:]
        if b == "{":
            out += "{" + a + "}" + b + tail
        else:
            out += "{" + a + "}{" + b + "}" + tail
    return out


def _fix_slash_fraction(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalize_answer(s: str) -> str:
    """Normalise a MATH answer string for comparison (see module docstring)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    if "\\text{ " in s:  # trailing units such as "5 \text{ cm}"
        s = s.split("\\text{ ")[0]
    s = re.sub(r"\\(?:text|textbf|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    s = s.strip()
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:
        s = sides[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash_fraction(s)


def _as_number(s: str) -> Decimal | None:
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = s.replace("{,}", "")
    if not re.fullmatch(r"-?\d+(\.\d+)?", s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def is_equiv(answer: str, ground_truth: str) -> bool:
    """Normalised string equality, or equal values when both are plain numbers."""
    a, b = normalize_answer(answer), normalize_answer(ground_truth)
    if a == b:
        return True
    na, nb = _as_number(a), _as_number(b)
    return na is not None and nb is not None and na == nb


def compute_score(solution_str: str, ground_truth: Any, score: float = 1.0) -> float:
    """1.0 if the last boxed answer equals the ground truth after normalisation, else 0.0."""
    answer = last_boxed_content(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    boxed_truth = last_boxed_content(truth)
    if boxed_truth is not None:
        truth = boxed_truth
    return score if is_equiv(answer, truth) else 0.0
