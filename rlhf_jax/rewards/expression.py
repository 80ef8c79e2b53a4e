"""A safe evaluator for arithmetic expressions written by a model.

The text is parsed with ``ast`` and only integer literals, the binary operators
``+ - * /`` and parentheses are accepted; names, calls, attributes, unary signs,
powers, floats, strings and everything else are rejected. Evaluation is exact
(``fractions.Fraction``), so ``/`` is true division with no rounding. Model output
is never passed to ``eval``.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_EXPRESSION_CHARS = 512

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class UnsafeExpression(ValueError):
    """The text is not a plain arithmetic expression over integer literals."""


def _walk(node: ast.AST, numbers: list[int]) -> Fraction:
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:  # bool is a subclass of int and is rejected here too
            raise UnsafeExpression(f"only integer literals are allowed, got {node.value!r}")
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left = _walk(node.left, numbers)
        right = _walk(node.right, numbers)
        op = type(node.op)
        if op is ast.Add:
            return left + right
        if op is ast.Sub:
            return left - right
        if op is ast.Mult:
            return left * right
        if right == 0:
            raise ZeroDivisionError("division by zero in expression")
        return left / right
    raise UnsafeExpression(f"disallowed syntax: {type(node).__name__}")


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """Evaluate an expression exactly; returns (value, integer literals used in order).

    Raises UnsafeExpression for anything but integers, + - * / and parentheses,
    ZeroDivisionError for a division by zero.
    """
    if len(text) > MAX_EXPRESSION_CHARS:
        raise UnsafeExpression(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise UnsafeExpression(f"not a valid expression: {e}") from None
    numbers: list[int] = []
    try:
        value = _walk(tree.body, numbers)
    except RecursionError:
        raise UnsafeExpression("expression nested too deeply") from None
    return value, numbers
