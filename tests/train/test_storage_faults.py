"""What a run meets on disk, through ``python -m rlhf_jax.main`` on real files: a half-copied model directory, a
filesystem that fills up during a checkpoint save, a damaged latest checkpoint. Each case's whole stderr is the one
expected line."""

import os
import re
import shutil
import subprocess

import pytest

from rlhf_jax.runtime.checkpoint import Checkpointer
from tests.train.helpers import cli_args, read_metrics, run_main
from tests.train.test_resume import _assert_same_rows

ONE_DEVICE = {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}
TOKENIZER_FILES = "tokenizer files (tokenizer.json, vocab.json, vocab.txt, *.model or *.tiktoken)"


def _stderr_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def _config_json_only(directory) -> str:
    """A model directory as an interrupted download leaves it: the tiny model's config.json and nothing else."""
    from rlhf_jax.models.hub import resolve_model_path

    os.makedirs(directory)
    shutil.copy(os.path.join(resolve_model_path("builtin:tiny"), "config.json"), directory)
    return str(directory)


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.path", "data.tokenizer"])
def test_model_directory_with_only_a_config_names_the_missing_files(tmp_path, key):
    half = _config_json_only(tmp_path / "half_download")
    proc = run_main(cli_args(str(tmp_path / "run"), **{key: half, **ONE_DEVICE}), devices=1, timeout=300)
    lacking = TOKENIZER_FILES + (" and weights (*.safetensors)" if key.endswith("model.path") else "")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _stderr_lines(proc) == [f"error: {key}: the model directory {half} lacks {lacking}; it holds: config.json"], \
        proc.stderr[-3000:]
    assert not os.path.exists(tmp_path / "run" / "checkpoints")  # stopped before anything was built


# ---------------------------------------------------------------------------------------------- a full disk
def _mount_tmpfs(directory: str, size_kib: int, remount: bool = False) -> None:
    """A real small filesystem (tmpfs, needs root as in CI); a failed mount fails the test: nothing else fills a
    disk for real."""
    options = ("remount," if remount else "") + f"size={size_kib}k"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", directory], capture_output=True, text=True)
    assert done.returncode == 0, f"cannot mount a {size_kib} KiB tmpfs on {directory}: {done.stderr.strip()}"


def _bytes_under(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(directory) for n in names)


def test_full_disk_during_a_save_stops_in_one_line_and_the_same_command_resumes(tmp_path):
    steps = {"trainer.total_training_steps": 3, "trainer.save_freq": 1, **ONE_DEVICE}
    reference = str(tmp_path / "reference")
    proc = run_main(cli_args(reference, **steps), devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Room for the checkpoint of step 1 and half of another: the save of step 2 meets a full filesystem.
    size_kib = _bytes_under(os.path.join(reference, "checkpoints", "1")) * 3 // 2 // 1024

    out = str(tmp_path / "run")
    ckpt = os.path.join(out, "checkpoints")
    os.makedirs(ckpt)
    _mount_tmpfs(ckpt, size_kib)
    try:
        args = cli_args(out, **steps)
        full = run_main(args, devices=1, fresh=True)  # nothing after the line, the interpreter's end included
        assert full.returncode == 2, full.stderr[-3000:]
        assert _stderr_lines(full) == [
            f"error: cannot write the checkpoint of step 2 in {ckpt}: No space left on device; the checkpoint of "
            "step 1 is intact (free space and run the same command to resume)"], full.stderr[-3000:]
        c = Checkpointer(ckpt, async_save=False)
        assert c.all_steps() == [1] and c.restore_extra(1)["step"] == 1
        c.close()

        _mount_tmpfs(ckpt, 64 << 10, remount=True)  # space freed
        again = run_main(args, devices=1, fresh=True)
        assert again.returncode == 0, again.stderr[-3000:]
        assert _stderr_lines(again) == [], again.stderr[-3000:]
        rows, expected = read_metrics(out), read_metrics(reference)
        assert [r["step"] for r in rows] == [1, 2, 3]
        for a, b in zip(expected, rows):
            _assert_same_rows(a, b)
        c = Checkpointer(ckpt, async_save=False)
        assert c.all_steps() == [1, 2, 3]
        c.close()
    finally:
        subprocess.run(["umount", ckpt], check=False)


# ---------------------------------------------------------------------------------------------- a damaged checkpoint
def _overwrite(path: str) -> None:
    """Same size, no valid byte (0xff starts no UTF-8 character, no zstd frame, no OCDBT node)."""
    with open(path, "r+b") as f:
        f.write(b"\xff" * os.path.getsize(path))


def _largest_data_file(item_dir: str) -> str:
    """The item's largest OCDBT data file: compressed array chunks, not an index node."""
    data = os.path.join(item_dir, "ocdbt.process_0", "d")
    return max((os.path.join(data, n) for n in os.listdir(data)), key=os.path.getsize)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("two") / "run")
    proc = run_main(cli_args(out, **{"trainer.total_training_steps": 2, "trainer.save_freq": 1, **ONE_DEVICE}),
                    devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


DAMAGE = {  # case -> (damage to the checkpoint of step 2, what the warning says after "cannot be read: ", a regex)
    "item_deleted": (lambda step: shutil.rmtree(os.path.join(step, "actor_params")),
                     lambda step: re.escape(f"{step}/actor_params: No such file or directory")),
    "array_chunks_overwritten": (lambda step: _overwrite(_largest_data_file(os.path.join(step, "actor_params"))),
                                 lambda step: re.escape(f"{step}/actor_params: FAILED_PRECONDITION: "
                                                        "ZSTD_decompressStream() failed: Unknown frame descriptor")),
    "manifest_deleted": (lambda step: os.remove(os.path.join(step, "actor_opt", "manifest.ocdbt")),
                         lambda step: re.escape(f"{step}/actor_opt: NOT_FOUND: Metadata at ") + r'"[^"]+"'
                         + re.escape(" in OCDBT database does not exist")),
    "extra_overwritten": (lambda step: _overwrite(os.path.join(step, "extra", "metadata")),
                          lambda step: re.escape(f"{step}/extra: UnicodeDecodeError: 'utf-8' codec can't decode byte "
                                                 "0xff in position 0: invalid start byte")),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_latest_checkpoint_is_one_warning_line(tmp_path, two_checkpoints, case):
    damage, says = DAMAGE[case]
    out = str(tmp_path / "run")
    shutil.copytree(two_checkpoints, out)
    step = os.path.join(out, "checkpoints", "2")
    damage(step)
    proc = run_main(cli_args(out, **{"trainer.total_training_steps": 3, "trainer.save_freq": 1, **ONE_DEVICE}),
                    devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = _stderr_lines(proc)
    expected = (re.escape(f"warning: checkpoint {step} cannot be read: ") + says(step)
                + re.escape(f"; moved to {step}.unreadable, resuming from step 1"))
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_asyncio_reports_of_a_failed_restores_reads_are_dropped_whenever_they_come():
    """A failed restore leaves reads in flight; asyncio logs each one's error ("exception was never retrieved")
    when it is garbage-collected, at any later time. Those of TensorStore's futures carry no frame, only a status
    line naming the store's spec or its OCDBT database; they are dropped too, and nothing else asyncio reports is."""
    import logging

    from rlhf_jax.runtime.storage_noise import _ORBAX_FAILURES

    def record(message, error):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None,
                                 (type(error), error, error.__traceback__))

    store = ValueError('NOT_FOUND: Error opening "zarr" driver: Metadata at "x/.zarray" does not exist '
                       '[tensorstore_spec=\'{"driver":"zarr"}\']')
    assert not _ORBAX_FAILURES.filter(record("Future exception was never retrieved\nfuture: <Future finished>", store))
    assert not _ORBAX_FAILURES.filter(record("Task exception was never retrieved\nfuture: <Task finished>", store))
    ocdbt = ValueError('FAILED_PRECONDITION: Error reading "model.layers.1.mlp.down_proj.value/0.0" in OCDBT '
                       'database at local file "run/checkpoints/2/actor_params/": ZSTD_decompressStream() failed')
    assert not _ORBAX_FAILURES.filter(record("Future exception was never retrieved\nfuture: <Future finished>", ocdbt))
    other = ValueError("a user's own coroutine failed")
    assert _ORBAX_FAILURES.filter(record("Task exception was never retrieved\nfuture: <Task finished>", other))
    try:  # the same status line raised by Python code (a frame in its traceback) is not TensorStore's: it stays
        raise ValueError(str(ocdbt))
    except ValueError as raised:
        assert _ORBAX_FAILURES.filter(record("Task exception was never retrieved\nfuture: <Task finished>", raised))
    assert _ORBAX_FAILURES.filter(record("Unclosed client session", store))


def test_closed_loop_noise_that_starts_inside_another_line_is_dropped_and_the_line_kept():
    """A writer thread's traceback can begin in the middle of the error line (between print's two writes): the
    line stays, the closed-event-loop noise goes, and any other traceback still prints whole."""
    import io

    from rlhf_jax.runtime.storage_noise import _NoiseFilter

    out = io.StringIO()
    stream = _NoiseFilter(out)
    stream.write("error: cannot write the checkpoint of step 2; resume)")
    stream.write('Traceback (most recent call last):\n  File "/x/asyncio/base_events.py", line 806, in '
                 "call_soon_threadsafe\n    self._check_closed()\n")
    stream.write("\n    raise RuntimeError('Event loop is closed')\nRuntimeError: Event loop is closed\n")
    stream.write('Traceback (most recent call last):\n  File "mine.py", line 1, in f\nValueError: mine\n')
    stream.close()
    assert out.getvalue() == ("error: cannot write the checkpoint of step 2; resume)\nTraceback (most recent call "
                              'last):\n  File "mine.py", line 1, in f\nValueError: mine\n')
