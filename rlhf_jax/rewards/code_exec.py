"""Code-execution reward for verl's code data sources (codecontests, apps, codeforces, taco).

The ground truth is verl's test-case JSON: ``{"inputs": [...], "outputs": [...]}`` for programs that read
stdin and write stdout, plus ``"fn_name"`` for call-based problems (each input is the list of arguments, each
output the return value; a LeetCode-style ``class Solution`` method works too). The answer's code is its last
```python block (the whole answer when there is none; ``<think>`` sections are dropped). Each test runs in
``sandbox.run_python`` with its own limits.

The score follows verl's prime_code scorer with ``continuous=True``: 1.0 when every test passes, otherwise
the fraction of the first ``max_tests`` tests that pass. Outputs compare token by token (whitespace-separated,
so trailing spaces and newlines do not matter).
"""

from __future__ import annotations

import json
import re
from typing import Any

from rlhf_jax.rewards.sandbox import Limits, run_python

DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")

_CALL_HARNESS = """
import json, sys
{solution}

_args = json.loads(sys.stdin.read())
_fn = globals().get({fn_name!r})
if _fn is None and "Solution" in globals():
    _fn = getattr(Solution(), {fn_name!r})
_result = _fn(*_args)
if isinstance(_result, tuple):
    _result = list(_result)
print(json.dumps(_result))
"""


def extract_code(answer: str) -> str:
    """The last ```python block of ``answer`` (the whole answer without one), with <think> sections removed."""
    text = re.sub(r"<think>.*?</think>", "", answer, flags=re.DOTALL | re.IGNORECASE)
    if "```python" in text:
        return text.split("```python")[-1].split("```")[0]
    return text


def _same_output(got: str, expected: Any) -> bool:
    if isinstance(expected, list):
        expected = "\n".join(map(str, expected))
    return str(got).split() == str(expected).split()


def _passes(code: str, fn_name: str | None, test_input: Any, expected: Any, limits: Limits) -> bool:
    if fn_name is None:
        stdin = test_input if isinstance(test_input, str) else "\n".join(map(str, test_input))
        result = run_python(code, stdin, limits)
        return result.ok and _same_output(result.stdout, expected)
    harness = _CALL_HARNESS.format(solution=code, fn_name=fn_name)
    args = test_input if isinstance(test_input, list) else [test_input]
    result = run_python(harness, json.dumps(args), limits)
    if not result.ok:
        return False
    try:
        got = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False
    want = expected[0] if isinstance(expected, list) and len(expected) == 1 and not isinstance(got, list) else expected
    return got == want


def compute_score(solution_str: str, ground_truth: Any, *, timeout_s: float = 5.0, memory_mb: int = 1024,
                  max_tests: int = 10) -> float:
    """1.0 if every test passes, else the fraction of the first ``max_tests`` that pass; 0.0 for unusable tests."""
    try:
        tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else dict(ground_truth)
        inputs, outputs = list(tests["inputs"]), list(tests["outputs"])
    except (ValueError, TypeError, KeyError):
        return 0.0
    if not inputs or len(inputs) != len(outputs):
        return 0.0
    code = extract_code(solution_str)
    limits = Limits(cpu_s=timeout_s, wall_s=2 * timeout_s + 1, memory_mb=memory_mb)
    fn_name = tests.get("fn_name")
    passed = []
    for test_input, expected in zip(inputs, outputs):
        passed.append(_passes(code, fn_name, test_input, expected, limits))
        if len(passed) >= max_tests and not all(passed):
            break  # not a full pass, and the first max_tests are scored
    if len(passed) == len(inputs) and all(passed):
        return 1.0
    first = passed[:max_tests]
    return sum(first) / len(first)
