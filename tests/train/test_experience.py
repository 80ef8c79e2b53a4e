"""Experience produced ahead of training (train/experience.py): overlap with staleness 1 on separate rollout
devices, an experience buffer of K batches, the pending batches in the checkpoint, and the config checks."""

import glob
import json
import os

import jax
import numpy as np
import pytest

from rlhf_jax.runtime.checkpoint import Checkpointer
from rlhf_jax.runtime.preemption import StopRequest
from rlhf_jax.train.setup import prepare
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, read_metrics

SPLIT = {"mesh.rollout_devices": 4, "mesh.tensor": 1}
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/")


class StopAfter(StopRequest):
    """A stop request that arrives once the trainer has finished ``steps`` steps (as a SIGTERM then would)."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps, self.trainer = steps, None

    def agreed(self) -> bool:
        return self.trainer is not None and self.trainer.loop.step >= self.steps

    @property
    def name(self) -> str:
        return "the test"


def _dumps(rollout_dir: str) -> dict[int, list[dict]]:
    """The rollout dump of each step: {step: rows}."""
    out = {}
    for path in glob.glob(os.path.join(rollout_dir, "*.jsonl")):
        with open(path) as f:
            out[int(os.path.basename(path).split(".")[0])] = [json.loads(line) for line in f]
    return out


def _run(out_dir: str, stop_after: int | None = None, recipe: str = "grpo", **overrides) -> Trainer:
    cfg = make_config(out_dir, recipe, **{"trainer.rollout_data_dir": os.path.join(out_dir, "rollouts"), **overrides})
    stop = StopAfter(stop_after) if stop_after is not None else StopRequest()
    trainer = Trainer(cfg, stop=stop)
    stop.trainer = trainer
    trainer.fit()
    return trainer


def _same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        ra = {k: v for k, v in ra.items() if not k.startswith(VOLATILE)}
        rb = {k: v for k, v in rb.items() if not k.startswith(VOLATILE)}
        assert ra.keys() == rb.keys()
        for k in ra:
            if isinstance(ra[k], float):
                np.testing.assert_allclose(rb[k], ra[k], rtol=1e-6, atol=1e-6, err_msg=f"step {ra['step']} {k}")
            else:
                assert ra[k] == rb[k], (ra["step"], k)


def _params(trainer: Trainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(trainer.actor.params)]


def test_overlap_trains_one_update_behind_and_resumes_exactly(tmp_path):
    steps = {"trainer.total_training_steps": 4, "trainer.save_freq": 2, "experience.overlap": True,
             "experience.max_staleness": 1, **SPLIT}
    full = _run(str(tmp_path / "full"), **steps)
    rows = read_metrics(str(tmp_path / "full"))
    # Step s trains on a batch sampled with the weights of update max(0, s - 2): the first round is sampled before
    # any update, every later one while the previous batch trains.
    assert [r["training/weight_version"] for r in rows] == [0, 0, 1, 2]
    assert [r["training/staleness"] for r in rows] == [0, 1, 1, 1]
    dumps = _dumps(str(tmp_path / "full" / "rollouts"))
    assert sorted(dumps) == [1, 2, 3, 4]  # no batch sampled beyond the last step
    for step, dump in dumps.items():
        assert {row["weight_version"] for row in dump} == {max(0, step - 2)}
        assert all(0 <= step - 1 - row["weight_version"] <= 1 for row in dump)  # trained version - sampled version
    assert all(r["timing_s/wait_rollout"] >= 0 for r in rows[:3]) and rows[0]["actor/grad_norm"] > 0

    # Stopped after step 2 (as by SIGTERM): the batch sampled for step 3 during step 2 is in the checkpoint ...
    part = str(tmp_path / "part")
    _run(part, stop_after=2, **steps)
    extra = Checkpointer(os.path.join(part, "checkpoints"), async_save=False).restore_extra(2)
    assert [p["version"] for p in extra["pending"]] == [1]
    # ... and the resumed run trains on it: steps 3 and 4 as in the uninterrupted run, weights bit-identical.
    resumed = _run(part, **steps)
    _same_rows(rows, read_metrics(part))
    for a, b in zip(_params(full), _params(resumed)):
        np.testing.assert_array_equal(a, b)
    assert _dumps(os.path.join(part, "rollouts")).keys() == dumps.keys()


def test_buffer_of_two_trains_each_batch_once_in_order_and_a_resume_loses_none(tmp_path):
    steps = {"trainer.total_training_steps": 4, "trainer.save_freq": 1, "experience.buffer_size": 2}
    full = _run(str(tmp_path / "full"), **steps)
    rows = read_metrics(str(tmp_path / "full"))
    assert [r["training/weight_version"] for r in rows] == [0, 0, 2, 2]
    # The prompts come in the loader's order, one batch per step: those of an on-policy run.
    onpolicy = _run(str(tmp_path / "onpolicy"), **{**steps, "experience.buffer_size": 1})
    a, b = _dumps(str(tmp_path / "full" / "rollouts")), _dumps(str(tmp_path / "onpolicy" / "rollouts"))
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert [r["input"] for r in a[step]] == [r["input"] for r in b[step]]
    del onpolicy
    # Stopped between the fill and the training of the round's second batch: the checkpoint holds that batch.
    part = str(tmp_path / "part")
    _run(part, stop_after=1, **steps)
    resumed = _run(part, **steps)
    _same_rows(rows, read_metrics(part))
    for x, y in zip(_params(full), _params(resumed)):
        np.testing.assert_array_equal(x, y)


def test_dynamic_sampling_overlapped_with_training_resumes_exactly(tmp_path):
    """DAPO's dynamic sampling (algorithm.filter_groups) while the previous batch trains: each batch draws further
    prompt batches until its groups vary, all sampled with the weights copied before the update. A checkpoint
    keeps how many prompt batches each pending batch drew, so the resumed run's loader stands where the
    uninterrupted run's did: the batch sampled after the resume draws the same prompts, and every step is the same."""
    from tests.train.test_verl_semantics import HALF_FLAT_REWARD

    reward = tmp_path / "reward.py"
    reward.write_text(HALF_FLAT_REWARD)
    steps = {"custom_reward_function.path": str(reward), "algorithm.filter_groups.metric": "acc",
             "actor_rollout_ref.rollout.n": 4, "data.max_response_length": 8,
             "reward_model.overlong_buffer.enable": False, "trainer.total_training_steps": 4,
             "trainer.save_freq": 2, "experience.overlap": True, **SPLIT}
    full = _run(str(tmp_path / "full"), recipe="dapo", **steps)
    rows = read_metrics(str(tmp_path / "full"))
    assert [r["training/weight_version"] for r in rows] == [0, 0, 1, 2]
    assert all(r["train/num_gen_batches"] >= 2 for r in rows)  # half the groups are flat: one batch never fills
    assert all(0 < r["critic/score/mean"] < 1 for r in rows)  # only varied groups are trained on

    part = str(tmp_path / "part")
    _run(part, stop_after=2, recipe="dapo", **steps)
    extra = Checkpointer(os.path.join(part, "checkpoints"), async_save=False).restore_extra(2)
    assert [p["version"] for p in extra["pending"]] == [1] and extra["pending"][0]["draws"] >= 2
    # step 4's batch is sampled after the resume, from where the pending batch's draws left the loader
    resumed = _run(part, recipe="dapo", **steps)
    _same_rows(rows, read_metrics(part))
    for a, b in zip(_params(full), _params(resumed)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("overrides,message", [
    ({"experience.overlap": True}, r"experience\.overlap=True .* set mesh\.rollout_devices"),
    ({"experience.max_staleness": -1}, r"experience\.max_staleness=-1 must be >= 0"),
    ({"experience.buffer_size": 0}, r"experience\.buffer_size=0 must be >= 1"),
    ({"experience.buffer_size": 2, "experience.max_staleness": 0}, r"experience\.max_staleness=0: .*up to 1 updates"),
    ({"experience.overlap": True, "experience.max_staleness": 0, **SPLIT}, r"experience\.max_staleness=0"),
    ({"mesh.rollout_devices": 9}, r"mesh\.rollout_devices=9 must be 0 \(shared devices\) or in \[1, 7\]"),
    ({"experience.partial_rollout_tokens": 2, **SPLIT, "experience.overlap": True},
     r"experience\.partial_rollout_tokens=2 .*set mesh\.rollout_processes"),
    ({"experience.partial_rollout_wait": True}, r"experience\.partial_rollout_wait=True .*partial_rollout_tokens"),
])
def test_bad_experience_settings_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        prepare(make_config(str(tmp_path), **overrides))


def test_pending_batches_keep_their_per_token_versions_and_routes_through_a_checkpoint():
    """Partial rollouts' per-token versions and R3's expert ids are saved with the pending batches and come back as
    they were (a resumed R3 run replays the routes its sampler chose)."""
    from rlhf_jax.train import experience as X
    from rlhf_jax.types import RolloutBatch, ScoredBatch

    rng = np.random.default_rng(0)
    rows = {name: jax.numpy.asarray(rng.integers(0, 5, (4, 3)), np.int32) for name in X.ROLLOUT_ARRAYS}
    rows["logprobs"] = jax.numpy.asarray(rng.normal(size=(4, 3)), np.float32)
    rows["finished"] = jax.numpy.asarray([True, False, True, False])
    versions = jax.numpy.asarray([[3, 3, 4], [3, 4, 4], [3, -1, -1], [4, 4, 4]], np.int32)
    routes = jax.numpy.asarray(rng.integers(-1, 8, (4, 6, 2, 2)), np.int32)  # (N, P + R, layers, k)
    batch = ScoredBatch(rollout=RolloutBatch(**rows, versions=versions, routed_experts=routes),
                        scores=jax.numpy.zeros(4), baselines=None, prompts=None, version=3, data_state=None,
                        metrics={"m": 1.0}, components=None)
    arrays, described = X.to_checkpoint([batch])
    assert described[0]["arrays"]["versions"] == [[4, 3], "int32"]
    assert described[0]["arrays"]["routed_experts"] == [[4, 6, 2, 2], "int32"]
    back = X.from_checkpoint(arrays, described, [None], [None])[0]
    np.testing.assert_array_equal(back.rollout.versions, versions)
    np.testing.assert_array_equal(back.rollout.routed_experts, routes)
    assert back.version == 3
    plain = batch.replace(rollout=batch.rollout.replace(versions=None, routed_experts=None))
    arrays, described = X.to_checkpoint([plain])
    assert "versions" not in described[0]["arrays"] and "routed_experts" not in described[0]["arrays"]
    back = X.from_checkpoint(arrays, described, [None], [None])[0]
    assert back.rollout.versions is None and back.rollout.routed_experts is None
