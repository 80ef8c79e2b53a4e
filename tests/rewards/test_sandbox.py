"""The code sandbox (real child processes) and the code-execution reward built on it."""

import json
import os
import time

import pytest

from rlhf_jax.rewards import code_exec
from rlhf_jax.rewards.registry import scorer_name
from rlhf_jax.rewards.sandbox import Limits, run_python

LIMITS = Limits(cpu_s=1, wall_s=3, memory_mb=256)


def test_a_well_behaved_program_reads_stdin_and_writes_its_directory():
    result = run_python("n = int(input())\nopen('scratch.txt', 'w').write(str(n * 2))\nprint(open('scratch.txt').read())",
                        "21\n", LIMITS)
    assert result.ok and result.stdout.strip() == "42", result


@pytest.mark.parametrize("name,code,status,message", [
    ("loops forever", "while True:\n    pass\n", "timeout", ""),
    ("sleeps forever", "import time\ntime.sleep(1000)\n", "timeout", ""),
    ("allocates 10 GB", "x = bytearray(10 * 2**30)\n", "error", "MemoryError"),
    ("forks repeatedly", "import os\nwhile True:\n    os.fork()\n", "error", "os.fork is not allowed"),
    ("starts a process", "import subprocess\nsubprocess.run(['true'])\n", "error", "subprocess.Popen is not allowed"),
    ("opens a socket", "import socket\nsocket.create_connection(('127.0.0.1', 9))\n", "error", "socket"),
    ("loads C code", "import ctypes\n", "error", "importing ctypes is not allowed"),
])
def test_misbehaving_code_is_stopped_within_its_limits(name, code, status, message):
    start = time.monotonic()
    result = run_python(code, "", LIMITS)
    assert time.monotonic() - start < LIMITS.wall_s + 2
    assert result.status == status and message in result.stderr, (name, result)


def test_writing_outside_the_directory_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')", f"import os\nos.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)",
                 f"import pathlib\npathlib.Path({str(tmp_path)!r}, 'x').mkdir()"):
        result = run_python(code, "", LIMITS)
        assert result.status == "error" and "not allowed" in result.stderr, result
    assert os.listdir(tmp_path) == []


STDIN_TESTS = json.dumps({"inputs": ["1 2\n", "5 7\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "12\n", "7\n", "0\n"]})


def test_code_reward_scores_like_verl_prime_code():
    right = "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_exec.compute_score(right, STDIN_TESTS, timeout_s=2) == 1.0
    # Wrong on the negative case only: the fraction of the tests passed.
    partly = "```python\na, b = map(int, input().split())\nprint(abs(a) + abs(b))\n```"
    assert code_exec.compute_score(partly, STDIN_TESTS, timeout_s=2) == pytest.approx(0.75)
    # Thinking is dropped; the last python block counts; no block: the whole answer is the program.
    assert code_exec.compute_score("<think>```python\nprint(0)\n```</think>" + right, STDIN_TESTS, timeout_s=2) == 1.0
    assert code_exec.compute_score("print(sum(map(int, input().split())))", STDIN_TESTS, timeout_s=2) == 1.0
    # Only the first max_tests count once a test fails.
    many = json.dumps({"inputs": [f"{i}\n" for i in range(6)], "outputs": ["0\n", "1\n", "2\n", "x\n", "x\n", "x\n"]})
    assert code_exec.compute_score("print(input())", many, timeout_s=2, max_tests=4) == pytest.approx(0.75)


def test_call_based_problems_call_the_function_or_solution_method():
    tests = json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]})
    assert code_exec.compute_score("```python\ndef add(a, b):\n    return a + b\n```", tests, timeout_s=2) == 1.0
    leetcode = "```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```"
    assert code_exec.compute_score(leetcode, tests, timeout_s=2) == 1.0
    assert code_exec.compute_score("```python\ndef add(a, b):\n    return a - b\n```", tests, timeout_s=2) == 0.0


def test_hostile_or_broken_answers_score_zero_quickly():
    start = time.monotonic()
    for answer in ("```python\nwhile True:\n    pass\n```", "```python\nimport os\nos.fork()\n```",
                   "```python\nx = bytearray(10 * 2**30)\n```", "not code at all", ""):
        assert code_exec.compute_score(answer, STDIN_TESTS, timeout_s=1, memory_mb=256) == 0.0
    assert time.monotonic() - start < 30
    assert code_exec.compute_score("print(1)", "not json") == 0.0
    assert code_exec.compute_score("print(1)", json.dumps({"inputs": ["1"], "outputs": []})) == 0.0


def test_verl_code_data_sources_use_it():
    for source in ("codecontests", "apps", "codeforces", "taco", "deepmind/CodeContests"):
        assert scorer_name(source) == "code", source
