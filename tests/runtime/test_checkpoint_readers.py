"""Readers of a checkpoint directory (the resume lookup, export) create and delete nothing: only the run's writer
deletes the unfinished steps a killed run left. Two managers deleting them at once raced, and the loser's
'No such file or directory' stopped the resumed run at its first save."""

import os

import jax.numpy as jnp
import numpy as np

from rlhf_jax.runtime.checkpoint import Checkpointer, resolve_resume

ARRAYS = {"actor_params": {f"w{i}": jnp.full((4,), float(i)) for i in range(300)}}  # many files: a slow delete


def _killed_mid_save(directory: str) -> str:
    """Steps 1 and 2 saved, then step 2 made unfinished under Orbax's temporary name, as a kill mid-save leaves it."""
    ckpt = Checkpointer(directory, async_save=False)
    for step in (1, 2):
        ckpt.save(step, ARRAYS, {"step": step})
    ckpt.close()
    unfinished = os.path.join(directory, "2.orbax-checkpoint-tmp-1234")
    os.rename(os.path.join(directory, "2"), unfinished)
    return unfinished


def test_the_resume_lookup_leaves_unfinished_steps_to_the_writer_whose_next_save_succeeds(tmp_path):
    directory = str(tmp_path / "checkpoints")
    unfinished = _killed_mid_save(directory)
    writer = Checkpointer(directory)  # the run's own, created first (RunLoop), then the lookup (resume)
    assert resolve_resume(directory, "auto", None) == (directory, 1)
    writer.save(2, ARRAYS, {"step": 2})
    writer.close()
    assert not os.path.exists(unfinished)  # the writer deleted it: Orbax took it for an unfinished step
    assert writer.complete_steps() == [1, 2]
    restored = Checkpointer(directory, read_only=True).restore_arrays(2, ARRAYS)
    np.testing.assert_array_equal(restored["actor_params"]["w7"], np.full((4,), 7.0))


def test_a_reader_of_a_missing_directory_creates_nothing(tmp_path):
    directory = str(tmp_path / "nothing_yet")
    assert resolve_resume(directory, "auto", None) == (directory, None)
    assert not os.path.exists(directory)
