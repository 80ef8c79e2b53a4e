"""Custom reward files scored by the naive and prime managers: errors and hangs score 0, are counted, never crash."""

import os
import textwrap
import time

import numpy as np
import pytest

from rlhf_jax.config import base_config
from rlhf_jax.rewards import RewardFunctionError, RewardLoadError, RewardManager, ScoreSpec, load_function_from_file

CUSTOM = textwrap.dedent(
    """
    import os
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "raise":
            raise ValueError("bad input " + str(extra_info.get("i")))
        if solution_str == "hang":
            time.sleep(60)
        if solution_str == "spin":
            while True:
                pass
        if solution_str == "dict":
            return {"score": 0.5, "acc": 1.0, "note": "text is ignored"}
        if solution_str == "none":
            return None
        if solution_str == "pid":
            return float(os.getpid())
        return float(solution_str == ground_truth) + 0.25 * len(data_source)

    def other(data_source, solution_str, ground_truth, extra_info):
        return 7
    """
)


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return str(path)


def _batch(solutions):
    n = len(solutions)
    return dict(data_sources=["ab"] * n, solutions=solutions, ground_truths=["ok"] * n,
                extra_infos=[{"i": i} for i in range(n)])


@pytest.mark.parametrize("kind", ["naive", "prime"])
def test_errors_and_hangs_score_zero_and_are_counted(reward_file, kind):
    solutions = ["ok", "raise", "hang", "no", "dict", "none", "ok", "hang", "raise"]
    expected = [1.5, 0.0, 0.0, 0.5, 0.5, 0.0, 1.5, 0.0, 0.0]
    with RewardManager(ScoreSpec(path=reward_file), reward_manager=kind, num_workers=3, timeout_s=1.5) as mgr:
        start = time.monotonic()
        result = mgr.score(**_batch(solutions))
        elapsed = time.monotonic() - start
        np.testing.assert_array_equal(result.scores, np.asarray(expected, dtype=np.float32))
        assert result.scores.dtype == np.float32
        assert (result.num_errors, result.num_timeouts) == (3, 2)  # 2 raise + 1 None; 2 hangs
        assert elapsed < 20, elapsed  # hangs are cut at the timeout, not the 60 s sleep
        assert result.extras["acc"][4] == 1.0 and np.isnan(result.extras["acc"][0])
        m = result.metrics()
        assert m["reward/num_errors"] == 3 and m["reward/num_timeouts"] == 2 and m["reward_extra/acc/mean"] == 1.0
        # the manager keeps working after the failures, and totals accumulate
        again = mgr.score(**_batch(["ok", "raise"]))
        np.testing.assert_array_equal(again.scores, [1.5, 0.0])
        assert mgr.metrics() == {"reward/num_errors_total": 4.0, "reward/num_timeouts_total": 2.0}


def test_prime_replaces_a_spinning_worker(reward_file):
    with RewardManager(ScoreSpec(path=reward_file), reward_manager="prime", num_workers=2, timeout_s=1.0) as mgr:
        pids_before = set(mgr._pool.pids)
        result = mgr.score(**_batch(["spin", "ok", "ok", "ok"]))
        np.testing.assert_array_equal(result.scores, [0.0, 1.5, 1.5, 1.5])
        assert result.num_timeouts == 1 and mgr._pool.num_replaced == 1
        pids_after = set(mgr._pool.pids)
        assert len(pids_after - pids_before) == 1
        killed = (pids_before - pids_after).pop()
        for _ in range(50):  # the killed worker is gone
            try:
                os.kill(killed, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("spinning worker still alive")
        worker_pids = mgr.score(**_batch(["pid"] * 4)).scores
        assert set(int(p) for p in worker_pids) <= pids_after


@pytest.mark.parametrize("kind", ["naive", "prime"])
def test_fail_on_error(reward_file, kind):
    with RewardManager(ScoreSpec(path=reward_file), reward_manager=kind, num_workers=2, timeout_s=5.0,
                       fail_on_error=True) as mgr:
        with pytest.raises(RewardFunctionError, match=r"(?s)error on response 1 \(data_source='ab'\).*bad input 1"):
            mgr.score(**_batch(["ok", "raise"]))


def test_builtin_scorers_through_prime_and_config(reward_file):
    cfg = base_config()  # the key table's defaults, with what this test varies
    r = cfg.reward_model
    r.reward_manager, r.num_workers, r.timeout_s = "prime", 2, 5.0
    r.scorer_kwargs = {"arithmetic": {"format_score": 0.2}}
    r.overlong_buffer.enable, r.overlong_buffer.len, r.overlong_buffer.penalty_factor = True, 4, 1.0
    with RewardManager.from_config(r, cfg.custom_reward_function, max_response_length=16) as mgr:
        result = mgr.score(["arithmetic", "openai/gsm8k", "arithmetic"], ["7", "#### 3", "8"], ["7", "3", "7"],
                           None, response_lengths=[4, 14, 16])
    # scores 1.0, 1.0, 0.2 plus DAPO penalty min(-(L - 12)/4, 0): 0, -0.5, -1
    np.testing.assert_allclose(result.scores, [1.0, 0.5, -0.8], rtol=0, atol=1e-6)
    np.testing.assert_allclose(result.overlong_penalty, [0.0, -0.5, -1.0], atol=1e-7)
    cfg = base_config()
    cfg.custom_reward_function.path, cfg.custom_reward_function.name = reward_file, "other"
    other = RewardManager.from_config(cfg.reward_model, cfg.custom_reward_function)
    assert other.score(["x"], ["y"], ["z"]).scores.tolist() == [7.0]


def test_load_errors(tmp_path, reward_file):
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path"):
        load_function_from_file(str(tmp_path / "missing.py"))
    with pytest.raises(RewardLoadError, match="no function named 'nope'"):
        load_function_from_file(reward_file, "nope")
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    for kind in ("naive", "prime"):  # found by parsing, before any worker starts
        with pytest.raises(RewardLoadError, match=r"broken\.py line 1: SyntaxError"):
            RewardManager(ScoreSpec(path=str(broken)), reward_manager=kind, num_workers=1)
    failing = tmp_path / "failing.py"
    failing.write_text("import os\n\nos.environ['X']\n\ndef compute_score(*a):\n    return 1.0\n")
    with pytest.raises(RewardLoadError, match=r"failing\.py line 3: KeyError"):
        load_function_from_file(str(failing))
    with pytest.raises(RewardLoadError, match=r"could not load the scoring function: .*failing\.py line 3: KeyError"):
        RewardManager(ScoreSpec(path=str(failing)), reward_manager="prime", num_workers=1).score(["a"], ["b"], ["c"])
    with pytest.raises(ValueError, match="reward_manager must be one of"):
        RewardManager(reward_manager="limited")


BATCH_FN = """
def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    CALLS.append(len(solution_strs))
    return [{"score": float(s == g), "length": float(len(s))} for s, g in zip(solution_strs, ground_truths)]

CALLS = []

def calls():
    return CALLS
"""


def test_batch_manager_calls_once_with_lists_and_dapo_is_naive(tmp_path):
    path = tmp_path / "batch_reward.py"
    path.write_text(BATCH_FN)
    with RewardManager(ScoreSpec(path=str(path)), reward_manager="batch", timeout_s=5.0) as mgr:
        result = mgr.score(["a", "a", "b"], ["1", "2", "3"], ["1", "1", "3"])
        np.testing.assert_array_equal(result.scores, [1.0, 0.0, 1.0])
        np.testing.assert_array_equal(result.extras["length"], [1.0, 1.0, 1.0])
        assert mgr._fn.__globals__["CALLS"] == [3]  # one call for the whole batch
    # A batch function that fails scores every row 0 and counts each.
    short = tmp_path / "short_batch_reward.py"
    short.write_text("def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n    return [1.0]\n")
    with RewardManager(ScoreSpec(path=str(short)), reward_manager="batch", timeout_s=5.0) as mgr:
        result = mgr.score(["a", "a"], ["1", "2"], ["1", "1"])
        assert result.num_errors == 2 and not result.scores.any()
    # dapo: the per-response function with the overlong penalty, as verl's DAPO manager.
    with RewardManager(ScoreSpec(), reward_manager="dapo", overlong_buffer_len=2, overlong_penalty_factor=1.0,
                       max_response_length=4) as mgr:
        result = mgr.score(["arithmetic"] * 2, ["3", "3"], ["3", "3"], response_lengths=[1, 4])
        np.testing.assert_allclose(result.scores, [1.0, 0.0])


EXITS = textwrap.dedent(
    """
    import os
    import sys
    from os import _exit

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "os_exit":
            os._exit(3)
        if solution_str == "bound_exit":
            _exit(4)
        if solution_str == "sys_exit":
            sys.exit(5)
        return 1.0
    """
)


@pytest.mark.parametrize("timeout_s", [2.0, None])  # calls in threads, or in this thread
def test_naive_exits_fail_only_their_call(tmp_path, timeout_s):
    path = tmp_path / "exits.py"
    path.write_text(EXITS)
    with RewardManager(ScoreSpec(path=str(path)), reward_manager="naive", num_workers=2, timeout_s=timeout_s) as mgr:
        result = mgr.score(**_batch(["ok", "os_exit", "bound_exit", "sys_exit", "ok"]))
    np.testing.assert_array_equal(result.scores, [1.0, 0.0, 0.0, 0.0, 1.0])
    assert (result.num_errors, result.num_timeouts) == (3, 0)
