"""The bad-input battery: real runs of ``python -m rlhf_jax.main`` on broken data, reward code, configs and disks.

Every case either stops with exit code 2 and one line naming the file/row/key (no traceback), leaving the
previous checkpoint of the run directory untouched, or, for faults of a reward function, completes with
the failed calls scored 0 and counted.
"""

import json
import math
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_jax.runtime.checkpoint import Checkpointer
from tests.cli_zygote import popen_module
from tests.train.helpers import cli_args, cpu_devices_flags, read_metrics, run_main

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
# One run per manager scores every fault: each prompt row's ground truth names the fault its reward call has.
REWARD_FAULTS = {  # what compute_score does for the row, and the score it must get
    "returns_one": ("return 1.0", 1.0),  # controls: a fault must not spill over to its neighbours
    "returns_dict_with_score": ("return {'score': 1.0, 'acc': 1.0}", 1.0),
    "raises": ("raise ValueError('boom')", 0.0),
    "returns_none": ("return None", 0.0),
    "returns_nan": ("return float('nan')", 0.0),
    "returns_inf": ("return float('inf')", 0.0),
    "returns_string": ("return 'high'", 0.0),
    "dict_without_score": ("return {'acc': 1.0}", 0.0),
    "hangs": ("time.sleep(120)", 0.0),
    "sys_exit": ("sys.exit(3)", 0.0),
    "os_exit": ("os._exit(3)", 0.0),
    "bound_os_exit": ("_exit(3)", 0.0),  # os._exit bound when the file was imported
    "prints_megabytes": ("print('x' * 4_000_000); return 1.0", 1.0),  # noisy but correct: scored as it returns
}
TIMEOUT_FAULTS = {"hangs"}
FAULT_STEPS, FAULT_SAMPLES = 2, 2


def _fault_reward_file(path) -> None:
    lines = ["import os, sys, time", "from os import _exit", "", "",
             "def compute_score(data_source, solution_str, ground_truth, extra_info):"]
    for fault, (body, _) in REWARD_FAULTS.items():
        lines += [f"    if ground_truth == {fault!r}:", f"        {body}"]
    lines.append("    raise AssertionError(ground_truth)")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module", params=["naive", "prime"])
def reward_fault_run(request, tmp_path_factory):
    """One run of FAULT_STEPS steps whose every batch holds one prompt per fault: (metrics, rollout rows)."""
    tmp = tmp_path_factory.mktemp(f"faults_{request.param}")
    reward, data = tmp / "reward.py", tmp / "faults.jsonl"
    _fault_reward_file(reward)
    data.write_bytes(_jsonl([{"prompt": f"{i}+1=", "data_source": "faults", "answer": fault}
                             for i, fault in enumerate(REWARD_FAULTS)]))
    out, n = str(tmp / "run"), len(REWARD_FAULTS)
    proc = run_main(cli_args(out, **{
        **ONE_DEVICE, "trainer.total_training_steps": FAULT_STEPS, "data.train_files": (str(data),),
        "data.train_batch_size": n, "actor_rollout_ref.rollout.n": FAULT_SAMPLES,
        "actor_rollout_ref.actor.ppo_mini_batch_size": n, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": n,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": n,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": n,
        "trainer.rollout_data_dir": str(tmp / "rollouts"),
        "custom_reward_function.path": str(reward), "reward_model.reward_manager": request.param,
        "reward_model.num_workers": 4, "reward_model.timeout_s": 1.0}), devices=1, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert os.path.isdir(os.path.join(out, "checkpoints", str(FAULT_STEPS)))
    rows = []
    for step in range(1, FAULT_STEPS + 1):
        with open(tmp / "rollouts" / f"{step}.jsonl") as f:
            rows += [json.loads(line) for line in f]
    return read_metrics(out), rows


@pytest.mark.parametrize("fault", sorted(REWARD_FAULTS))
def test_reward_function_faults_score_zero_and_the_run_completes(reward_fault_run, fault):
    metrics, rows = reward_fault_run
    assert [r["step"] for r in metrics] == list(range(1, FAULT_STEPS + 1))
    assert all(isinstance(r["actor/pg_loss"], float) and math.isfinite(r["actor/pg_loss"]) for r in metrics)
    scores = [r["score"] for r in rows if r["gts"] == fault]
    assert scores == [REWARD_FAULTS[fault][1]] * (FAULT_STEPS * FAULT_SAMPLES), scores
    # Every failed call of every step was counted, as an error or (hangs) a timeout.
    failed = [f for f, (_, score) in REWARD_FAULTS.items() if score == 0.0]
    timeouts = sum(r["reward/num_timeouts"] for r in metrics)
    errors = sum(r["reward/num_errors"] for r in metrics)
    per_fault = FAULT_STEPS * FAULT_SAMPLES
    assert timeouts == per_fault * len(TIMEOUT_FAULTS)
    assert errors == per_fault * (len(failed) - len(TIMEOUT_FAULTS))


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
    from rlhf_jax.models.hub import resolve_model_path

    out = tmp_path / "no_weights"
    shutil.copytree(resolve_model_path("builtin:tiny"), out)
    for name in os.listdir(out):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(out / name)
    return str(out)


def _model_without_chat_template(tmp_path) -> str:
    from rlhf_jax.models.hub import resolve_model_path

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
def _garble(paths):
    for path in paths:
        with open(path, "r+b") as f:
            size = max(os.path.getsize(path), 16)
            f.write(os.urandom(size))


def _files(directory):
    return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]


CHECKPOINT_DAMAGE = {  # step -> (case, damage): the resumed run meets them newest first, one after another
    5: ("actor_params_deleted", lambda step: shutil.rmtree(os.path.join(step, "actor_params"))),
    4: ("array_data_garbled", lambda step: _garble(f for f in _files(os.path.join(step, "actor_params"))
                                                   if os.sep + "d" + os.sep in f)),
    3: ("extra_garbled", lambda step: _garble(_files(os.path.join(step, "extra")))),
    2: ("optimizer_manifest_deleted", lambda step: os.remove(os.path.join(step, "actor_opt", "manifest.ocdbt"))),
}
DAMAGED = {case: step for step, (case, _) in CHECKPOINT_DAMAGE.items()}


@pytest.fixture(scope="module")
def damaged_resume(tmp_path_factory):
    """Checkpoints of steps 1-5, each of 2-5 damaged its own way, then a resumed run of 6 steps: it must fall
    back step by step to checkpoint 1. Returns (checkpoint dir, first run's metrics, resumed run's process)."""
    out = str(tmp_path_factory.mktemp("damaged") / "run")
    last = max(CHECKPOINT_DAMAGE)
    proc = run_main(cli_args(out, **{"trainer.total_training_steps": last, "trainer.save_freq": 1, **ONE_DEVICE}),
                    devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = read_metrics(out)
    ckpt = os.path.join(out, "checkpoints")
    for step, (_, damage) in CHECKPOINT_DAMAGE.items():
        damage(os.path.join(ckpt, str(step)))
    proc = run_main(cli_args(out, **{"trainer.total_training_steps": last + 1, "trainer.save_freq": 1, **ONE_DEVICE}),
                    devices=1, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, last + 2))  # steps 2.. ran again from checkpoint 1, logged once
    from tests.train.test_resume import _assert_same_rows

    for step in range(2, last + 1):  # ... exactly as the first time
        _assert_same_rows(first[step - 1], rows[step - 1])
    c = Checkpointer(ckpt, async_save=False)
    assert c.all_steps() == list(range(1, last + 2))
    c.close()
    return ckpt, proc


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_unreadable_latest_checkpoint_falls_back_to_the_previous_one(damaged_resume, case):
    ckpt, proc = damaged_resume
    step = DAMAGED[case]
    warning = [line for line in proc.stderr.splitlines() if f"{ckpt}/{step} cannot be read" in line]
    assert len(warning) == 1 and f"resuming from step {step - 1}" in warning[0], proc.stderr[-3000:]
    assert os.path.isdir(os.path.join(ckpt, f"{step}.unreadable"))  # set aside, not deleted


def _small_files_only():
    """In the child process: files stop growing at 64 KiB, as on a full disk (writes fail with EFBIG instead of
    the process being killed by SIGXFSZ). The tiny model's checkpoint has larger files; its logs do not."""
    import resource
    import signal

    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, finished_run):
    out = str(tmp_path / "run")
    shutil.copytree(finished_run, out)
    ckpt = os.path.join(out, "checkpoints")
    before = _snapshot(os.path.join(ckpt, "1"))
    args = cli_args(out, **{"trainer.total_training_steps": 2, **ONE_DEVICE})
    proc = run_main(args, devices=1, timeout=300, preexec_fn=_small_files_only)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: cannot write the checkpoint of step 2 in " + ckpt), lines[0]
    assert "File too large" in lines[0] and "step 1 is intact" in lines[0], lines[0]
    assert _snapshot(os.path.join(ckpt, "1")) == before
    # With room again, the same command resumes from step 1 and completes.
    again = run_main(args, devices=1, timeout=300)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    c = Checkpointer(ckpt, async_save=False)
    assert c.all_steps() == [1, 2]
    c.close()


def test_out_of_memory_in_a_step_is_one_line_naming_the_keys(tmp_path, finished_run):
    """An allocation that fails inside a step, despite the memory plan: a real XLA RESOURCE_EXHAUSTED (a 1 TiB
    buffer, refused by the host as a device allocation too large would be) becomes the one line main prints."""
    import jax
    import jax.numpy as jnp

    from rlhf_jax.train.trainer import Trainer
    from tests.train.helpers import make_config

    out = str(tmp_path / "run")
    shutil.copytree(finished_run, out)
    trainer = Trainer(make_config(out))
    try:
        with pytest.raises(Exception) as caught:
            jax.jit(lambda a: jnp.broadcast_to(a[0], (1 << 40,)) * 2)(jnp.ones(4)).block_until_ready()
        assert "RESOURCE_EXHAUSTED" in str(caught.value)
        trainer.loop.plan_memory(trainer)  # the planned passes' size keys are what the message names
        message = trainer.out_of_memory(caught.value)
        assert message is not None and "\n" not in message
        assert message.startswith("out of memory in training step 1 (RESOURCE_EXHAUSTED"), message
        for key in ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "enable_gradient_checkpointing",
                    "compute_dtype=bfloat16", "mesh.fsdp", f"step 1 in {out}/checkpoints is intact"):
            assert key in message, (key, message)
        assert trainer.out_of_memory(ValueError("not memory")) is None
    finally:
        trainer.close()


def test_second_run_on_the_same_directory_refuses(tmp_path, finished_run):
    import signal
    import time

    from tests.train.helpers import REPO

    out = str(tmp_path / "run")
    # Far more steps than the test lasts: the first run must still be training when it is signalled; it saves only
    # at the end, so its one checkpoint is the stop's (save_freq <= 0 would save nothing, as in verl).
    args = cli_args(out, **{"trainer.total_training_steps": 100_000, "trainer.save_freq": 100_000, **ONE_DEVICE})
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flags(1))
    first = popen_module("rlhf_jax.main", args, env=env, cwd=REPO, stderr=f"{out}.err")
    try:
        deadline, metrics = time.time() + 300, os.path.join(out, "metrics.jsonl")
        # until the first run has logged a step: its stop then has a step to save and the third run one to resume
        while not (os.path.exists(metrics) and os.path.getsize(metrics)) and time.time() < deadline:
            assert first.poll() is None, open(f"{out}.err").read()[-3000:]
            time.sleep(0.1)
        second = run_main(args, devices=1, timeout=300)
        assert first.poll() is None, "the first run ended before the second started"
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
        error = second.stderr.strip().splitlines()[-1]
        assert error.startswith("error: ") and out in error and "in use by another run" in error, error
        assert f"pid {first.pid}" in error
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0, open(f"{out}.err").read()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == list(range(1, len(steps) + 1))  # only the first run wrote metrics
    # The lock went with the first run: a third run resumes.
    third = run_main(cli_args(out, **{"trainer.total_training_steps": steps[-1] + 1, **ONE_DEVICE}), devices=1)
    assert third.returncode == 0, third.stderr[-3000:]
