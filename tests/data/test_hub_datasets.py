"""Datasets by Hub id: an ``hf:<org>/<name>?subset=...&split=...`` entry of data.train_files / val_files is read with
the real ``datasets`` library from a local cache laid out by the test (no network, HF_HUB_OFFLINE=1); Trinity's
``path`` + ``subset_name`` + ``split`` map onto it; errors are one line naming the entry."""

import os

import pytest

from rlhf_jax.config.hub_data import parse
from rlhf_jax.config.yaml_import import load_yaml
from rlhf_jax.data.sources import DataError, read_files
from tests.data.hub_cache import cache_dataset
from tests.train.helpers import run_main

TRAIN = [{"question": f"{i}+{j}=", "answer": str(i + j)} for i in range(4) for j in range(4)]
TEST = [{"question": f"{i}+2=", "answer": str(i + 2)} for i in range(4)]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = cache_dataset(str(tmp_path / "datasets"), "acme/sums",
                          {"main": {"train": TRAIN, "test": TEST}, "small": {"train": TRAIN[:3]}})
    monkeypatch.setenv("HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets.config  # it read the environment at import: point it at this cache

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


def test_entry_syntax():
    assert parse("hf:acme/sums") == ("acme/sums", None, None, None)
    assert parse("hf:acme/sums?subset=main&split=test&revision=v1") == ("acme/sums", "main", "test", "v1")
    for bad in ("hf:acme/sums?name=main", "hf:../x", "hf:acme/sums?subset="):
        with pytest.raises(ValueError, match=r"hf:"):
            parse(bad)


def test_rows_by_subset_and_split_from_the_offline_cache(hub):
    rows = read_files(["hf:acme/sums?subset=main"], "train")
    assert [r.data for r in rows] == TRAIN and rows[0].where == "hf:acme/sums?subset=main row 0"
    assert [r.data for r in read_files("hf:acme/sums?subset=main&split=test", "train")] == TEST  # entry's split wins
    assert len(read_files("hf:acme/sums?subset=small", "train")) == 3


def test_errors_are_one_line_naming_the_entry(hub):
    for entry, split, message in [
        ("hf:acme/sums?subset=nope", "train", r"hf:acme/sums\?subset=nope: .*'nope'.*main.*small"),
        ("hf:acme/sums?subset=main", "validation", r"hf:acme/sums\?subset=main: .*validation.*train.*test"),
        ("hf:acme/missing", "train", r"hf:acme/missing: dataset 'acme/missing' could not be read: not in the datasets "
                                     r"cache .*HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set"),
    ]:
        with pytest.raises(DataError, match=message) as e:
            read_files([entry], split)
        assert "\n" not in str(e.value) and "data.train_files / data.val_files" in str(e.value)


def test_trinity_taskset_path_and_subset_name_are_the_hub_entry():
    cfg = load_yaml("mode: both\nalgorithm:\n  algorithm_type: grpo\n  repeat_times: 2\nbuffer:\n  batch_size: 4\n"
                    "  explorer_input:\n    taskset:\n      path: acme/sums\n      subset_name: main\n      split: test\n")
    assert cfg.data.train_files == ("hf:acme/sums?subset=main",) and cfg.data.train_split == "test"
    with pytest.raises(ValueError, match=r"taskset\.subset_name='main': 'data/x\.jsonl' is neither a local path"):
        load_yaml("buffer:\n  batch_size: 4\n  explorer_input:\n    taskset:\n      path: data/x.jsonl\n"
                  "      subset_name: main\n")


_RUN = {"actor_rollout_ref.model.path": "builtin:tiny", "data.max_prompt_length": 48, "data.max_response_length": 4,
        "data.train_batch_size": 4, "data.val_batch_size": 4, "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "trainer.total_training_steps": 2,
        "trainer.n_gpus_per_node": 1, "trainer.val_before_train": False}


@pytest.mark.parametrize("keys", ["ours", "trinity"])
def test_hub_dataset_feeds_a_two_step_run(hub, tmp_path, keys):
    out = str(tmp_path / "run")
    config = tmp_path / "run.yaml"
    if keys == "ours":
        config.write_text("data:\n  train_files: ['hf:acme/sums?subset=main']\n  val_files: ['hf:acme/sums?subset=main"
                          "&split=test']\n  prompt_key: question\n  ground_truth_key: answer\n"
                          "  default_data_source: arithmetic\nalgorithm:\n  adv_estimator: grpo\n")
    else:
        config.write_text("mode: both\nalgorithm:\n  algorithm_type: grpo\nbuffer:\n  batch_size: 4\n  explorer_input:\n"
                          "    default_reward_fn_type: accuracy_reward\n    taskset:\n      path: acme/sums\n"
                          "      subset_name: main\n      split: train\n      format:\n        prompt_key: question\n"
                          "        response_key: answer\n    eval_tasksets:\n    - path: acme/sums\n"
                          "      subset_name: main\n      split: test\n      format:\n        prompt_key: question\n")
    args = [f"--config={config}"] + [f"--config.{k}={v}" for k, v in {**_RUN, "trainer.default_local_dir": out}.items()]
    proc = run_main(args, devices=1, env={"HF_DATASETS_CACHE": hub, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.isdir(os.path.join(out, "checkpoints", "2")) and "step 2" in proc.stdout
