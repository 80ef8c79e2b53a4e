"""The grain prompt loader: deterministic order, exact resume (also via Orbax on disk), per-process shards."""

import json

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rlhf_jax.config import base_config
from rlhf_jax.data.loader import PromptLoader, build_dataset, loader_from_config
from rlhf_jax.data.sources import DataError

N_ROWS, BATCH, EPOCHS = 23, 5, 3  # 4 full batches per epoch, 3 rows dropped each epoch


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def dataset(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("loader") / "rows.jsonl"
    rng = np.random.default_rng(1)
    rows = []
    for i in range(N_ROWS):
        words = " ".join(f"w{j}" for j in range(int(rng.integers(1, 12))))
        rows.append({"data_source": "arithmetic", "prompt": f"row {i}: {words}",
                     "reward_model": {"ground_truth": str(i)}, "extra_info": {"index": i}})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return build_dataset(str(path), tok, max_prompt_length=64)


def _loader(dataset, seed=0, **kw):
    args = dict(pad_token_id=2, max_prompt_length=64, buckets=(32, 48), shuffle=True, seed=seed,
                num_epochs=EPOCHS, process_index=0, process_count=1)
    args.update(kw)
    return PromptLoader(dataset, BATCH, **args)


def _order(loader):
    return [b.index.tolist() for b in loader]


def test_batch_contents(dataset):
    batch = next(_loader(dataset))
    assert batch.input_ids.dtype == np.int32 and batch.attention_mask.dtype == np.int32
    assert batch.input_ids.shape[0] == BATCH and batch.input_ids.shape[1] in (32, 48, 64)
    longest = max(len(dataset.input_ids[i]) for i in batch.index)
    assert batch.input_ids.shape[1] == min(b for b in (32, 48, 64) if b >= longest)
    for row, i in enumerate(batch.index):
        ids = dataset.input_ids[i]
        assert batch.input_ids[row, -len(ids):].tolist() == ids.tolist()
        assert batch.attention_mask[row].sum() == len(ids) and batch.attention_mask[row, -1] == 1
        assert batch.ground_truth[row] == str(i) and batch.extra_info[row]["index"] == i
        assert batch.raw_prompt[row].startswith(f"row {i}:") and batch.data_source[row] == "arithmetic"
        assert batch.prompt_text[row] == dataset.prompt_texts[i]
    assert (batch.epoch, batch.step) == (0, 0)


def test_same_seed_same_order_and_epochs_reshuffle(dataset):
    a, b, c = _order(_loader(dataset, 7)), _order(_loader(dataset, 7)), _order(_loader(dataset, 8))
    assert a == b and a != c
    assert len(a) == 4 * EPOCHS
    epochs = [sum(a[4 * e: 4 * e + 4], []) for e in range(EPOCHS)]
    for e in epochs:
        assert len(set(e)) == 20 and set(e) <= set(range(N_ROWS))  # no repeats within an epoch
    assert epochs[0] != epochs[1]
    assert sum(_order(_loader(dataset, shuffle=False))[:4], []) == list(range(20))


@pytest.mark.parametrize("k", [2, 4, 8])  # mid-epoch, exactly at an epoch end, at the second epoch end
def test_restore_gives_the_uninterrupted_batches(dataset, k):
    full = list(_loader(dataset, 3))
    it = _loader(dataset, 3)
    for _ in range(k):
        next(it)
    state = it.get_state()
    resumed = _loader(dataset, 3)
    resumed.set_state(state)
    rest = list(resumed)
    assert len(rest) == len(full) - k
    for want, got in zip(full[k:], rest):
        assert got.index.tolist() == want.index.tolist()
        np.testing.assert_array_equal(got.input_ids, want.input_ids)
        assert (got.epoch, got.step) == (want.epoch, want.step)
    assert rest[0].epoch == k // 4  # at a boundary the next epoch starts, iteration does not stop


@pytest.mark.parametrize("k", [3, 4, 9])
def test_another_loaders_state_moves_a_loader_there_without_reading_the_batches_before(dataset, k, monkeypatch):
    """A split run's sampling processes start where the training processes' loader stands (after a resume, past
    the pending batches' prompts): taking that state gives what drawing the batches before would, unread."""
    drawn = _loader(dataset, 5)
    for _ in range(k):
        next(drawn)
    collated, collate = [], PromptLoader._collate
    monkeypatch.setattr(PromptLoader, "_collate", lambda self, step, idx: collated.append(step) or collate(self, step, idx))
    moved = _loader(dataset, 5)
    moved.set_state(drawn.get_state())
    assert collated == [] and moved.get_state() == drawn.get_state()
    want, got = next(drawn), next(moved)
    assert got.index.tolist() == want.index.tolist() and (got.epoch, got.step) == (want.epoch, want.step) == (k // 4, k)
    assert collated == [k]  # only the batch drawn after the move was read


def test_orbax_round_trip_on_disk(dataset, tmp_path):
    full = list(_loader(dataset, 5))
    it = _loader(dataset, 5)
    for _ in range(4):  # stop exactly at the end of epoch 0
        next(it)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(4, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it.grain_iterator)))
        mngr.wait_until_finished()
    fresh = _loader(dataset, 5)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.restore(4, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh.grain_iterator)))
    rest = list(fresh)
    assert [b.index.tolist() for b in rest] == [b.index.tolist() for b in full[4:]]
    assert rest[0].epoch == 1


@pytest.mark.parametrize("procs", [2, 5])
def test_process_shards_are_disjoint_and_cover(dataset, procs):
    """Each process takes a disjoint share of every global batch; together they are the single-process run."""
    batch = 10
    single = list(PromptLoader(dataset, batch, pad_token_id=2, max_prompt_length=64, seed=4, num_epochs=2,
                               process_index=0, process_count=1))
    shards = [list(PromptLoader(dataset, batch, pad_token_id=2, max_prompt_length=64, seed=4, num_epochs=2,
                                process_index=p, process_count=procs)) for p in range(procs)]
    assert all(len(s) == len(single) for s in shards)
    for step, whole in enumerate(single):
        parts = [s[step].index.tolist() for s in shards]
        assert all(len(p) == batch // procs for p in parts)
        flat = sum(parts, [])
        assert len(set(flat)) == len(flat)  # disjoint
        assert flat == whole.index.tolist()  # cover the global batch, in order
    epoch0 = sum((s[step].index.tolist() for s in shards for step in range(2)), [])
    assert len(set(epoch0)) == 20  # 2 global batches of 10 per epoch from 23 rows


def _data(**keys):
    """A ``data`` section with the key table's defaults and ``keys`` set."""
    section = base_config().data
    section.update(keys)
    return section


def test_validation_loader_from_config(tok, tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(json.dumps({
        "train": [{"Question": f"q{i}", "Answer": str(i)} for i in range(12)],
        "test": [{"Question": f"t{i}", "Answer": str(i)} for i in range(7)],
    }))
    cfg = _data(
        train_files=(str(path),), val_files=(str(path),), train_split="train", val_split="test",
        prompt_key="Question", ground_truth_key="Answer", default_data_source="qa",
        prompt_template="native", system_prompt=None, max_prompt_length=48, truncation="error",
        filter_overlong_prompts=False, prompt_length_buckets=None, train_batch_size=4, val_batch_size=None,
        shuffle=True, seed=1,
    )
    train = loader_from_config(cfg, tok, "train", num_epochs=2, process_index=0, process_count=1)
    # Prompts of ~30 tokens land in the 32 bucket of the default (16, 32, 48).
    assert len(train) == 6 and all(b.input_ids.shape[0] == 4 and b.input_ids.shape[1] in (32, 48) for b in train)
    val = list(loader_from_config(cfg, tok, "val", process_index=0, process_count=1))
    assert len(val) == 1 and val[0].raw_prompt == [f"t{i}" for i in range(7)]
    assert val[0].ground_truth == [str(i) for i in range(7)]
    cfg.val_batch_size = 3
    val = list(loader_from_config(cfg, tok, "val", process_index=0, process_count=1))
    assert [len(b) for b in val] == [3, 3, 1]


def test_loader_errors(dataset):
    with pytest.raises(DataError, match="fewer than one batch"):
        PromptLoader(dataset, 100, pad_token_id=2, max_prompt_length=64, process_index=0, process_count=1)
    with pytest.raises(DataError, match="divisible by the number of processes"):
        PromptLoader(dataset, 5, pad_token_id=2, max_prompt_length=64, process_index=0, process_count=2)


def test_max_samples_keeps_a_seeded_subset_or_the_first_rows(tok, tmp_path):
    from rlhf_jax.data.loader import dataset_from_config

    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"data_source": "arithmetic", "prompt": f"row {i}", "answer": str(i)})
                              for i in range(20)))
    base = dict(train_files=(str(path),), val_files=(str(path),), max_prompt_length=64, seed=3)

    def indices(which, **kw):
        ds = dataset_from_config(_data(**{**base, **kw}), tok, which)
        return [int(e.ground_truth) for e in ds.examples]

    assert indices("val", val_max_samples=5) == [0, 1, 2, 3, 4]
    assert indices("val", val_max_samples=-1) == list(range(20))
    subset = indices("train", train_max_samples=6, shuffle=True)
    assert len(subset) == 6 and subset != list(range(6)) and subset == indices("train", train_max_samples=6)
    assert subset != indices("train", train_max_samples=6, seed=4)  # drawn with data.seed
    assert indices("train", train_max_samples=6, shuffle=False) == list(range(6))
    assert indices("train", train_max_samples=0) == list(range(20))


def test_rows_with_images_or_videos_are_refused_by_their_columns(tok, tmp_path):
    from rlhf_jax.data.loader import dataset_from_config

    path = tmp_path / "mm.jsonl"
    rows = [{"prompt": f"row {i}", "answer": str(i), "images": [], "pics": None} for i in range(4)]
    rows[2]["pics"] = ["cat.png"]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    base = dict(val_files=(str(path),), max_prompt_length=64)
    assert len(dataset_from_config(_data(**base), tok, "val").examples) == 4  # empty images
    with pytest.raises(DataError, match=r"mm\.jsonl.*row 2.*column 'pics' holds images/videos"):
        dataset_from_config(_data(**base, image_key="pics"), tok, "val")
    assert len(dataset_from_config(_data(**base, image_key=None), tok, "val").examples) == 4
