"""Rule-based scorers on tables of tricky cases, and dispatch by data_source."""

import pytest

from rlhf_jax.rewards import answer_match, arithmetic, countdown, gsm8k, math_boxed
from rlhf_jax.rewards.expression import UnsafeExpression, evaluate
from rlhf_jax.rewards.registry import check_data_sources, default_compute_score, register_scorer, scorer_name

GSM8K_STRICT = [
    ("She has 72 clips.\n#### 72", "72", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("The cost is #### $1,234.", "1234", 1.0),
    ("#### $5", "5", 1.0),
    ("#### -3", "-3", 1.0),
    ("#### -3", "3", 0.0),
    ("#### 72.0", "72", 1.0),
    ("#### 18.50", "18.5", 1.0),
    ("first #### 10 then corrected #### 12", "12", 1.0),
    ("first #### 12 then corrected #### 10", "12", 0.0),
    ("The answer is 72.", "72", 0.0),  # no #### -> no answer in strict mode
    ("####", "72", 0.0),
    ("", "72", 0.0),
    ("#### 7" + " filler" * 100, "7", 0.0),  # the marker is outside the last 300 characters
]

GSM8K_FLEXIBLE = [
    ("The answer is 72.", "72", 1.0),
    ("Total: $1,234.", "1234", 1.0),
    ("It drops to -15 degrees", "-15", 1.0),
    ("5 - 3 = 2", "2", 1.0),
    ("3 apples and 4 pears", "3", 0.0),
    ("no digits at all", "3", 0.0),
]


@pytest.mark.parametrize("response, truth, expected", GSM8K_STRICT)
def test_gsm8k_strict(response, truth, expected):
    assert gsm8k.compute_score(response, truth, method="strict") == expected


@pytest.mark.parametrize("response, truth, expected", GSM8K_FLEXIBLE)
def test_gsm8k_flexible(response, truth, expected):
    assert gsm8k.compute_score(response, truth, method="flexible") == expected


def test_gsm8k_format_score_and_no_answer():
    assert gsm8k.compute_score("#### 5", "6", format_score=0.1) == 0.1
    assert gsm8k.compute_score("nothing", "6", format_score=0.1) == 0.0
    assert gsm8k.extract_solution("#### $-1,000.") == "-1000"


MATH_CASES = [
    (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),  # nested braces
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})", 1.0),
    (r"\boxed{10\%}", "10", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{5 \text{ cm}}", "5", 1.0),
    (r"\boxed{x = 4}", "4", 1.0),
    (r"\boxed{\$18.90}", "18.90", 1.0),
    (r"\boxed{-7}", "-7", 1.0),
    (r"\boxed{-7}", "7", 0.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{.5}", r"\frac{1}{2}", 1.0),
    (r"first \boxed{3} then \boxed{4}", "4", 1.0),
    (r"\fbox{12}", "12", 1.0),
    (r"\boxed 7$.", "7", 1.0),
    (r"\boxed{\frac{2}{3}", r"\frac{2}{3}", 0.0),  # unbalanced braces: no answer
    ("The answer is 4.", "4", 0.0),  # no box
    (r"\boxed{4}", r"The answer is $\boxed{4}$", 1.0),  # boxed ground truth
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
]


@pytest.mark.parametrize("response, truth, expected", MATH_CASES)
def test_math(response, truth, expected):
    assert math_boxed.compute_score(response, truth) == expected


def test_last_boxed_nested():
    assert math_boxed.last_boxed_content(r"\boxed{a^{2}+\frac{b}{\{c\}}} end") == r"a^{2}+\frac{b}{\{c\}}"


ARITHMETIC_CASES = [
    ("19", "19", 1.0),
    ("  19\n", "19", 1.0),
    ("19.", "19", 1.0),
    ("Let me add: 12 + 7 = 19\n#### 19", "19", 1.0),
    ("#### -4", "-4", 1.0),
    ("1,234", "1234", 1.0),
    ("20", "19", 0.1),  # well-formed, wrong
    ("#### 18", "19", 0.1),
    ("19 apples", "19", 0.0),  # not an integer literal
    ("12 + 7 = 19", "19", 0.0),  # no #### and more than a number
    ("", "19", 0.0),
    ("#### ", "19", 0.0),
    ("1.5", "19", 0.0),
]


@pytest.mark.parametrize("response, truth, expected", ARITHMETIC_CASES)
def test_arithmetic(response, truth, expected):
    assert arithmetic.compute_score(response, truth, format_score=0.1) == expected


def test_arithmetic_format_score_is_configurable():
    assert arithmetic.compute_score("3", "4", format_score=0.25) == 0.25
    assert default_compute_score("arithmetic", "3", "4", None, {"arithmetic": {"format_score": 0.0}}) == 0.0


GT = {"target": 24, "numbers": [4, 6, 1]}
COUNTDOWN_CASES = [
    ("<answer>4 * 6 * 1</answer>", 1.0),
    ("<answer>4 * 6 * 1 * 1</answer>", 0.1),  # reuses a number (value is right)
    ("<answer>4 * 6</answer>", 0.1),  # leaves a number unused
    ("<answer>4 * 6 / 1 = 24</answer>", 1.0),  # trailing "= target" allowed
    ("<answer>(4 + 6) * 1</answer>", 0.1),  # wrong value
    ("<answer>__import__('os').system('echo hi')</answer>", 0.1),  # calls are rejected, never run
    ("<answer>abs(4) * 6 * 1</answer>", 0.1),
    ("<answer>4 ** 1 * 6</answer>", 0.1),
    ("<answer>-4 * -6 * 1</answer>", 0.1),  # unary minus is not allowed
    ("<answer>4.0 * 6 * 1</answer>", 0.1),
    ("<answer>4 * 6 / (1 - 1)</answer>", 0.1),  # division by zero
    ("<answer>1 + 1</answer> then <answer>(1 * 4) * 6</answer>", 1.0),  # the last block counts
    ("4 * 6 * 1", 0.0),  # no answer tags
]


@pytest.mark.parametrize("response, expected", COUNTDOWN_CASES)
def test_countdown(response, expected):
    assert countdown.compute_score(response, GT) == expected


def test_countdown_exact_division():
    gt = {"target": 2, "numbers": [3, 6, 9]}
    assert countdown.compute_score("<answer>(3 + 9) / 6</answer>", gt) == 1.0
    assert countdown.compute_score("<answer>9 / 6 + 3</answer>", gt) == 0.1  # 4.5


def test_expression_checker():
    assert evaluate("(1 + 2) * 3 / 4") == (pytest.approx(9 / 4), [1, 2, 3, 4])
    for bad in ("x + 1", "f(1)", "1 if 2 else 3", "[1]", "'a'", "1; 2", "(1).real", "2 ** 3", "True + 1",
                "(" * 500 + "1" + ")" * 500):
        with pytest.raises(UnsafeExpression):
            evaluate(bad)


def test_dispatch_by_data_source():
    assert scorer_name("openai/gsm8k") == "gsm8k" and scorer_name("gsm8k") == "gsm8k"
    assert scorer_name("lighteval/MATH") == "math" and scorer_name("HuggingFaceH4/MATH-500") == "math"
    assert scorer_name("DigitalLearningGmbH/MATH-lighteval") == "math"
    assert scorer_name("arithmetic") == "arithmetic" and scorer_name("countdown") == "countdown"
    assert scorer_name("someone/unknown") is None
    assert default_compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert default_compute_score("lighteval/MATH", r"\boxed{3}", "3") == 1.0
    # A data_source with no scorer of its own is scored by answer_match.
    assert default_compute_score("someone/unknown", "so it is 12", "12") == 1.0
    assert default_compute_score("someone/unknown", "x", "y") == 0.0
    assert default_compute_score("qa", "the answer is 12", "12", None, {"answer_match": {"mode": "exact"}}) == 0.0
    with pytest.raises(KeyError, match="unknown"):
        check_data_sources({"gsm8k", "unknown"})

    @register_scorer("test_echo_task", aliases=("org/echo",))
    def echo(solution_str, ground_truth, extra_info=None, bonus=0.0):
        return float(solution_str == ground_truth) + bonus + extra_info["w"]

    assert default_compute_score("org/echo", "a", "a", {"w": 0.5}, {"test_echo_task": {"bonus": 1.0}}) == 2.5


@pytest.mark.parametrize("response, truth, expected", [
    # (response, ground truth, {mode: score})
    ("Paris", "Paris.", dict(exact=1, numeric=0, last_number=0, any=1)),
    ("  the   answer  ", "The answer", dict(exact=1, numeric=0, last_number=0, any=1)),
    ("1,234.0", "1234", dict(exact=0, numeric=1, last_number=1, any=1)),
    ("So 3 + 4 = 7.", "7", dict(exact=0, numeric=0, last_number=1, any=1)),
    ("7 or maybe 8", "7", dict(exact=0, numeric=0, last_number=0, any=0)),
    ("72", "She pays 8 * 9 = 72 dollars.\n#### 72", dict(exact=0, numeric=1, last_number=1, any=1)),
    ("inf", "inf", dict(exact=1, numeric=0, last_number=0, any=1)),
    ("", "4", dict(exact=0, numeric=0, last_number=0, any=0)),
])
def test_answer_match_modes(response, truth, expected):
    for mode, score in expected.items():
        assert answer_match.compute_score(response, truth, mode=mode) == score, mode
    with pytest.raises(ValueError, match="reward_model.answer_match"):
        answer_match.compute_score("1", "1", mode="fuzzy")
