"""The bad-input battery: real runs of ``python -m rlhf_jax.main`` on broken data, reward code, configs and disks.

Every case either stops with exit code 2 and one line naming the file/row/key (no traceback), leaving the
previous checkpoint of the run directory untouched, or, for faults of a reward function, completes with
the failed calls scored 0 and counted.
"""

import json
import os
import shutil
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_jax.train.checkpoint import Checkpointer
from tests.train.helpers import cli_args, read_metrics, run_main

ONE_DEVICE = {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}


def _snapshot(directory: str) -> dict[str, int]:
    """Every file under ``directory`` with its size (what a failed run must not change)."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = os.path.getsize(path)
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run directory with a complete checkpoint of step 1."""
    out = str(tmp_path_factory.mktemp("finished") / "run")
    proc = run_main(cli_args(out, **{"trainer.total_training_steps": 1, **ONE_DEVICE}), devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _stops_cleanly(tmp_path, finished_run, overrides: dict, needles: tuple[str, ...], extra_args=()) -> str:
    """Run on a copy of ``finished_run`` with ``overrides``: exit 2, one error line holding every needle, no
    traceback, checkpoint untouched. Returns the error line."""
    out = str(tmp_path / "run")
    shutil.copytree(finished_run, out)
    ckpt = os.path.join(out, "checkpoints")
    before = _snapshot(ckpt)
    proc = run_main(cli_args(out, **{"trainer.total_training_steps": 2, **ONE_DEVICE, **overrides}) + list(extra_args),
                    devices=1, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = lines[-1]
    assert error.startswith(("error: ", "config error: ")), proc.stderr[-3000:]
    for needle in needles:
        assert needle in error, (needle, error)
    assert _snapshot(ckpt) == before
    return error


# ---------------------------------------------------------------------------------------------- bad data
def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


GOOD = {"prompt": "1+1=", "data_source": "arithmetic", "answer": "2"}
DATA_CASES = {
    "empty_file": ("empty.jsonl", b"", ("empty.jsonl", "no rows")),
    "malformed_line": ("bad.jsonl", _jsonl([GOOD, GOOD]) + b'{"prompt": "1+2=",\n', ("bad.jsonl", "line 3", "not valid JSON")),
    "not_utf8": ("latin.jsonl", _jsonl([GOOD]) + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"), ("latin.jsonl", "UTF-8")),
    "empty_prompt": ("blank.jsonl", _jsonl([GOOD, {**GOOD, "prompt": "  "}]), ("blank.jsonl row 1", "'prompt'", "empty")),
    "non_string_prompt": ("num.jsonl", _jsonl([{**GOOD, "prompt": 12}]), ("num.jsonl row 0", "'prompt'", "string")),
    "missing_ground_truth": ("nogt.jsonl", _jsonl([GOOD, {"prompt": "1+1=", "data_source": "arithmetic"}]),
                             ("nogt.jsonl row 1", "ground-truth")),
    "parquet_column_types": ("typed.parquet", None, ("typed.parquet row 0", "'prompt'", "string")),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_data(tmp_path, finished_run, case):
    name, content, needles = DATA_CASES[case]
    path = tmp_path / name
    if content is None:  # a prompt column of integers
        pq.write_table(pa.table({"prompt": pa.array([1, 2], pa.int64()), "answer": ["2", "3"]}), path)
    else:
        path.write_bytes(content)
    _stops_cleanly(tmp_path, finished_run, {"data.train_files": (str(path),)}, needles)


# ---------------------------------------------------------------------------------------------- bad reward code
REWARD_FAULTS = {  # body of compute_score, and the manager that runs it
    "raises": ("raise ValueError('boom')", "naive"),
    "returns_none": ("return None", "naive"),
    "returns_nan": ("return float('nan')", "naive"),
    "returns_inf": ("return float('inf')", "naive"),
    "returns_string": ("return 'high'", "naive"),
    "dict_without_score": ("return {'acc': 1.0}", "naive"),
    "hangs": ("time.sleep(120)", "naive"),
    "sys_exit": ("sys.exit(3)", "naive"),
    "os_exit": ("os._exit(3)", "prime"),
    "prints_megabytes": ("print('x' * 4_000_000); return 1.0", "naive"),
}


@pytest.mark.parametrize("case", sorted(REWARD_FAULTS))
def test_reward_function_faults_score_zero_and_the_run_completes(tmp_path, case):
    body, manager = REWARD_FAULTS[case]
    reward = tmp_path / "reward.py"
    reward.write_text(f"import os, sys, time\n\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                      f"    {body}\n")
    out = str(tmp_path / "run")
    proc = run_main(cli_args(out, **{"trainer.total_training_steps": 2, **ONE_DEVICE,
                                     "custom_reward_function.path": str(reward), "reward_model.reward_manager": manager,
                                     "reward_model.num_workers": 2, "reward_model.timeout_s": 1.0}),
                    devices=1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(isinstance(r["actor/pg_loss"], float) for r in rows)
    failed = sum(r["reward/num_errors"] + r["reward/num_timeouts"] for r in rows)
    if case == "prints_megabytes":  # noisy but correct: scored as it returns
        assert failed == 0 and rows[-1]["critic/score/mean"] == 1.0
    else:  # every call of both steps (4 prompts x 2 samples) failed, was scored 0 and counted
        assert failed == 2 * 8 and all(r["critic/score/mean"] == 0.0 for r in rows)
    assert os.path.isdir(os.path.join(out, "checkpoints", "2"))


IMPORTS_MISSING = "import not_a_module_anywhere\n\n\ndef compute_score(*args):\n    return 1.0\n"
BROKEN_REWARD_FILES = {
    "syntax_error": ("def compute_score(:\n", {}, ("reward.py", "line 1", "SyntaxError")),
    "missing_function": ("def score(*a):\n    return 1.0\n", {}, ("reward.py", "compute_score")),
    "wrong_name": ("def compute_score(*a):\n    return 1.0\n", {"custom_reward_function.name": "nope"},
                   ("reward.py", "'nope'")),
    "import_error": (IMPORTS_MISSING, {}, ("reward.py", "line 1", "not_a_module_anywhere")),
    "import_error_prime": (IMPORTS_MISSING, {"reward_model.reward_manager": "prime"},
                           ("reward.py", "line 1", "not_a_module_anywhere")),
    "missing_file": (None, {}, ("custom_reward_function.path", "absent.py")),
    "syntax_error_prime": ("def compute_score(:\n", {"reward_model.reward_manager": "prime"},
                           ("reward.py", "line 1", "SyntaxError")),
}


@pytest.mark.parametrize("case", sorted(BROKEN_REWARD_FILES))
def test_broken_reward_file_stops_before_training(tmp_path, finished_run, case):
    source, overrides, needles = BROKEN_REWARD_FILES[case]
    path = tmp_path / ("absent.py" if source is None else "reward.py")
    if source is not None:
        path.write_text(source)
    _stops_cleanly(tmp_path, finished_run, {"custom_reward_function.path": str(path), **overrides}, needles)


# ---------------------------------------------------------------------------------------------- bad config
def _model_without_weights(tmp_path) -> str:
    from rlhf_jax.config import resolve_model_path

    out = tmp_path / "no_weights"
    shutil.copytree(resolve_model_path("builtin:tiny"), out)
    for name in os.listdir(out):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(out / name)
    return str(out)


def _model_without_chat_template(tmp_path) -> str:
    from rlhf_jax.config import resolve_model_path

    out = tmp_path / "no_template"
    shutil.copytree(resolve_model_path("builtin:tiny"), out)
    if (out / "chat_template.jinja").exists():
        os.remove(out / "chat_template.jinja")
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(tok_cfg))
    return str(out)


CONFIG_CASES = {
    "misspelt_key": ({}, ["--config.trainer.total_trainig_steps=3"], ("total_training_steps",)),
    "wrong_type": ({}, ["--config.data.train_batch_size=four"], ("data.train_batch_size",)),
    "negative_lr": ({"actor_rollout_ref.actor.optim.lr": -1e-3}, [], ("actor_rollout_ref.actor.optim.lr",)),
    "n_1_with_grpo": ({"actor_rollout_ref.rollout.n": 1}, [], ("actor_rollout_ref.rollout.n", "grpo")),
    "mesh_does_not_divide": ({"mesh.data": 3}, [], ("mesh",)),
    "model_path_missing": ({"actor_rollout_ref.model.path": "/nonexistent/model"}, [],
                           ("actor_rollout_ref.model.path", "/nonexistent/model")),
    "model_without_weights": ({"actor_rollout_ref.model.path": _model_without_weights}, [],
                              ("no_weights", "safetensors")),
    "no_chat_template": ({"actor_rollout_ref.model.path": _model_without_chat_template,
                          "data.prompt_template": "native"}, [], ("chat template", "data.prompt_template")),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config(tmp_path, finished_run, case):
    overrides, extra, needles = CONFIG_CASES[case]
    overrides = {k: (v(tmp_path) if callable(v) else v) for k, v in overrides.items()}
    _stops_cleanly(tmp_path, finished_run, overrides, needles, extra_args=extra)


# ---------------------------------------------------------------------------------------------- faults
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run directory with complete checkpoints of steps 1 and 2."""
    out = str(tmp_path_factory.mktemp("two") / "run")
    proc = run_main(cli_args(out, **{"trainer.total_training_steps": 2, "trainer.save_freq": 1, **ONE_DEVICE}), devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _garble(paths):
    for path in paths:
        with open(path, "r+b") as f:
            size = max(os.path.getsize(path), 16)
            f.write(os.urandom(size))


def _files(directory):
    return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]


CHECKPOINT_DAMAGE = {
    "actor_params_deleted": lambda step: shutil.rmtree(os.path.join(step, "actor_params")),
    "array_data_garbled": lambda step: _garble(f for f in _files(os.path.join(step, "actor_params"))
                                               if os.sep + "d" + os.sep in f),
    "extra_garbled": lambda step: _garble(_files(os.path.join(step, "extra"))),
    "optimizer_manifest_deleted": lambda step: os.remove(os.path.join(step, "actor_opt", "manifest.ocdbt")),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_DAMAGE))
def test_unreadable_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, two_checkpoints, case):
    out = str(tmp_path / "run")
    shutil.copytree(two_checkpoints, out)
    ckpt = os.path.join(out, "checkpoints")
    CHECKPOINT_DAMAGE[case](os.path.join(ckpt, "2"))
    first_step_2 = read_metrics(out)[1]
    proc = run_main(cli_args(out, **{"trainer.total_training_steps": 3, "trainer.save_freq": 1, **ONE_DEVICE}),
                    devices=1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warning = [line for line in proc.stderr.splitlines() if "cannot be read" in line]
    assert len(warning) == 1 and f"{ckpt}/2 cannot be read" in warning[0] and "resuming from step 1" in warning[0]
    assert os.path.isdir(os.path.join(ckpt, "2.unreadable"))  # set aside, not deleted
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]  # step 2 ran again from checkpoint 1, logged once ...
    from tests.train.test_resume import _assert_same_rows

    _assert_same_rows(first_step_2, rows[1])  # ... exactly as the first time
    c = Checkpointer(ckpt, async_save=False)
    assert c.all_steps() == [1, 2, 3]
    c.close()


def test_second_run_on_the_same_directory_refuses(tmp_path, finished_run):
    import signal
    import subprocess
    import sys
    import time

    from tests.train.helpers import REPO

    out = str(tmp_path / "run")
    # Far more steps than the test lasts: the first run must still be training when it is signalled; it saves only
    # at the end, so its one checkpoint is the stop's (save_freq <= 0 would save nothing, as in verl).
    args = cli_args(out, **{"trainer.total_training_steps": 100_000, "trainer.save_freq": 100_000, **ONE_DEVICE})
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    first = subprocess.Popen([sys.executable, "-m", "rlhf_jax.main", *args], env=env, cwd=REPO, text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not os.path.exists(os.path.join(out, "metrics.jsonl")) and time.time() < deadline:
            assert first.poll() is None, first.stderr.read()[-3000:]
            time.sleep(0.1)
        second = run_main(args, devices=1, timeout=300)
        assert first.poll() is None, "the first run ended before the second started"
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
        error = second.stderr.strip().splitlines()[-1]
        assert error.startswith("error: ") and out in error and "in use by another run" in error, error
        assert f"pid {first.pid}" in error
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0, first.stderr.read()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == list(range(1, len(steps) + 1))  # only the first run wrote metrics
    # The lock went with the first run: a third run resumes.
    third = run_main(cli_args(out, **{"trainer.total_training_steps": steps[-1] + 1, **ONE_DEVICE}), devices=1)
    assert third.returncode == 0, third.stderr[-3000:]
