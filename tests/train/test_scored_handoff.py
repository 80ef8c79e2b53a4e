"""Produced batches of a split run (rlhf_jax/train/scored_handoff.py): four processes over gloo, two sampling and
two training; each batch arrives on the training mesh equal to what was sampled, and each training process holds
its rows of the prompts (gathered from both sampling processes, padded to one width)."""

from __future__ import annotations

from tests.parallel.rehearsal import rehearse
from tests.train.scored_handoff_worker import PAD


def test_a_produced_batch_moves_to_the_training_mesh_with_each_processs_prompt_rows():
    lines, _ = rehearse("tests.train.scored_handoff_worker", "split", watch=(0, 1))
    for process in (0, 1):
        assert [r["step"] for r in lines[process]] == [0, 1], lines[process]
        for r in lines[process]:
            step = r["step"]
            assert all(r["train_rows"].values()) and all(r["equal"].values()), r
            # training process 0 holds prompts 0-1 (sampling process 2's), 1 holds 2-3 (process 3's, wider)
            source = 2 + process
            assert r["prompt_ids"] == [[PAD, PAD, source, step], [PAD, PAD, source + 10, step]]
            assert r["mask"] == [[0, 0, 1, 1], [0, 0, 1, 1]]
            assert r["ground_truth"] == [f"gt{source}a", f"gt{source}b"] and r["index"] == [2 * source, 2 * source + 1]
            assert r["version"] == step and r["data_state"] == [f"state-2-{step}", f"state-3-{step}"]
            assert r["metrics"] == {"reward/mean": 0.5 + step} and r["baselines"]
