"""The servers that run the tests' command lines (tests/cli_warm.py, tests/cli_zygote.py) give what a fresh process
gives: the same metrics from the same run, and a run that restarts its process still runs."""

from __future__ import annotations

from tests.train.helpers import cli_args, read_metrics, run_main

# Measured, not computed: they depend on the process (its peak memory, its clock).
PROCESS_KEYS = ("perf/max_memory_allocated_gb", "perf/throughput", "perf/time_per_step")


def _numbers(out: str) -> list[dict]:
    return [{k: v for k, v in row.items()
             if isinstance(v, (int, float)) and k not in PROCESS_KEYS and not k.startswith("timing")}
            for row in read_metrics(out)]


def test_runs_served_one_after_another_write_what_fresh_processes_write(tmp_path):
    """Served by one process that keeps every run's programs: a run with another learning rate in between learns
    differently (no program of the first run stands in for one of its own), and the first run's settings again
    give the first run's numbers, as a fresh process does."""
    outs = {name: str(tmp_path / name) for name in ("first", "other", "again", "fresh")}
    for name, out in outs.items():
        lr = {"actor_rollout_ref.actor.optim.lr": 3e-3} if name == "other" else {}
        proc = run_main(cli_args(out, **lr), fresh=name == "fresh")
        assert proc.returncode == 0, proc.stderr[-3000:]
    first, other, again, fresh = (_numbers(out) for out in outs.values())
    assert len(first) == 2 and first[0]["actor/grad_norm"] > 0
    assert other[1]["actor/pg_loss"] != first[1]["actor/pg_loss"]
    assert again == first
    assert fresh == first


def test_a_run_that_restarts_its_process_for_its_environment_runs(tmp_path):
    """``trainer.env_vars`` restarts the command (os.execve), which a served run cannot do in its server."""
    out = str(tmp_path / "run")
    proc = run_main(cli_args(out, **{"trainer.env_vars": {"RLHF_JAX_TEST_MARK": "1"}}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "environment of the run (trainer.env_vars): RLHF_JAX_TEST_MARK=1" in proc.stderr
    assert len(read_metrics(out)) == 2
