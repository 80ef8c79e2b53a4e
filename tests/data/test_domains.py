"""Sampling training prompts by domain (data.domain_weights): ROLL's per-domain batch shares and row order, exact
resume, and the one-line errors naming the key."""

import json
import random

import numpy as np
import pytest

from rlhf_jax.config import base_config
from rlhf_jax.config.schema import get_key
from rlhf_jax.data.domains import DomainSpec, domain_counts
from rlhf_jax.data.loader import PromptLoader, build_dataset, loader_from_config
from rlhf_jax.data.sources import DataError
from rlhf_jax.rollout.dynamic_sampling import Collected

SIZES = {"math": 31, "code": 17, "qa": 9}  # rows per domain, interleaved in the file
WEIGHTS = {"math": 0.5, "code": 0.3, "qa": 0.2}
BATCH = 10  # shares 5, 3, 2


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _write(path, sizes=SIZES, column="domain"):
    rows, left = [], dict(sizes)
    while any(left.values()):
        for d in sizes:
            if left[d]:
                rows.append({"prompt": f"{d} question {left[d]}", "answer": "1", column: d})
                left[d] -= 1
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def dataset(tok, tmp_path_factory):
    path = _write(tmp_path_factory.mktemp("domains") / "rows.jsonl")
    return build_dataset(path, tok, max_prompt_length=64, domains=DomainSpec())


def _loader(dataset, seed=42, epochs=4, **kw):
    args = dict(pad_token_id=2, max_prompt_length=64, shuffle=True, seed=seed, num_epochs=epochs, process_index=0,
                process_count=1, domain_weights=WEIGHTS)
    args.update(kw)
    return PromptLoader(dataset, BATCH, **args)


def _domains(dataset, batch):
    return [dataset.examples[i].domain for i in batch.index]


def test_shares_follow_rolls_rule():
    """int(w x batch) for every domain but the last, which takes the rest, also when the weights sum below 1."""
    assert domain_counts({"a": 0.4, "b": 0.3, "c": 0.1, "d": 0.1}, 10) == {"a": 4, "b": 3, "c": 1, "d": 2}
    assert domain_counts({"a": 0.5, "b": 0.5}, 7) == {"a": 3, "b": 4}
    assert domain_counts({"only": 1.0}, 5) == {"only": 5}


def test_every_batch_has_the_domains_shares_and_each_domain_cycles_through_its_rows(dataset):
    """Proportions are exact in every batch (tolerance 0): 5 math, 3 code, 2 qa of 10, in data.domain_weights'
    order; each domain walks all its rows before repeating one (its own epochs, independent of the others')."""
    batches = list(_loader(dataset))
    assert len(batches) == 4 * ((31 + 17 + 9) // BATCH)  # an epoch: as many batches as the listed rows fill
    picks = {d: [] for d in SIZES}
    for b in batches:
        assert _domains(dataset, b) == ["math"] * 5 + ["code"] * 3 + ["qa"] * 2
        assert b.domain.tolist() == [0] * 5 + [1] * 3 + [2] * 2  # the per-domain statistics' segments
        for d, i in zip(_domains(dataset, b), b.index.tolist()):
            picks[d].append(i)
    rows = {d: sorted(i for i, e in enumerate(dataset.examples) if e.domain == d) for d in SIZES}
    for d, n in SIZES.items():
        seen = picks[d]
        assert len(seen) >= 2 * n
        assert sorted(seen[:n]) == rows[d] and sorted(seen[n:2 * n]) == rows[d]  # epochs 0 and 1 of the domain
        assert seen[:n] != seen[n:2 * n]  # reshuffled


def test_order_is_rolls_per_domain_reshuffle(dataset):
    """Epoch e of a domain is the previous epoch's order shuffled by random.Random(seed + e) (ROLL's scheduler)."""
    n, seed = SIZES["qa"], 42
    order, expected = list(range(n)), []
    for e in range(3):
        random.Random(seed + e).shuffle(order)
        expected += list(order)
    rows = [i for i, ex in enumerate(dataset.examples) if ex.domain == "qa"]
    got = [i for b in _loader(dataset, seed=seed) for i, d in zip(b.index.tolist(), _domains(dataset, b)) if d == "qa"]
    assert got[:3 * n] == [rows[p] for p in expected]
    in_order = [i for b in _loader(dataset, shuffle=False) for i, d in zip(b.index.tolist(), _domains(dataset, b))
                if d == "qa"]
    assert in_order[:2 * n] == rows + rows


def test_same_seed_same_batches_other_seed_others(dataset):
    a, b, c = ([x.index.tolist() for x in _loader(dataset, seed=s)] for s in (7, 7, 8))
    assert a == b and a != c


@pytest.mark.parametrize("k", [1, 3, 5, 9])  # mid-epoch, at the loader's epoch end (5 batches), past it
def test_resume_gives_the_uninterrupted_batches(dataset, k):
    full = list(_loader(dataset))
    it = _loader(dataset)
    for _ in range(k):
        next(it)
    resumed = _loader(dataset)
    resumed.set_state(it.get_state())
    rest = list(resumed)
    assert [b.index.tolist() for b in rest] == [b.index.tolist() for b in full[k:]]
    assert [(b.epoch, b.step) for b in rest] == [(b.epoch, b.step) for b in full[k:]]


def test_process_shares_cover_the_global_batch(dataset):
    single = list(_loader(dataset, epochs=1))
    shards = [list(_loader(dataset, epochs=1, process_index=p, process_count=2)) for p in range(2)]
    for step, whole in enumerate(single):
        assert shards[0][step].index.tolist() + shards[1][step].index.tolist() == whole.index.tolist()
        assert shards[0][step].domain.tolist() + shards[1][step].domain.tolist() == whole.domain.tolist()


def test_domain_from_tag_or_default(tok, tmp_path):
    """ROLL's rule for rows without a domain column: the reward worker listing the row's tag, else math_rule."""
    path = tmp_path / "tags.jsonl"
    rows = [{"prompt": "p0", "answer": "1", "tag": "deepmath_103k"}, {"prompt": "p1", "answer": "1", "tag": "aime"},
            {"prompt": "p2", "answer": "1", "tag": "other"}, {"prompt": "p3", "answer": "1", "domain": "code"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    spec = DomainSpec(tags={"math_rule": ["deepmath_103k"], "olympiad": ["aime"]}, default="math_rule")
    ds = build_dataset(str(path), tok, max_prompt_length=64, domains=spec)
    assert [e.domain for e in ds.examples] == ["math_rule", "olympiad", "math_rule", "code"]
    with pytest.raises(DataError, match=r"tags\.jsonl row 2: no domain: the row has no column 'domain' "
                                        r"\(data\.domain_key\) nor a 'tag' value listed in data\.domain_tags"):
        build_dataset(str(path), tok, max_prompt_length=64, domains=DomainSpec(tags=spec.tags))


def _data(**keys):
    section = base_config().data
    section.update(keys)
    return section


def test_loader_from_config_and_its_errors(tok, tmp_path):
    path = _write(tmp_path / "rows.jsonl", column="kind")
    d = _data(train_files=(path,), domain_weights=WEIGHTS, domain_key="kind", train_batch_size=BATCH,
              max_prompt_length=64, seed=3)
    loader = loader_from_config(d, tok, "train", process_index=0, process_count=1)
    assert _domains(loader.dataset, next(loader)) == ["math"] * 5 + ["code"] * 3 + ["qa"] * 2
    val = loader_from_config(_data(val_files=(path,), domain_weights=WEIGHTS, max_prompt_length=64), tok, "val",
                             process_index=0, process_count=1)
    assert val.domains is None and next(val).domain is None  # validation reads every row, in order

    with pytest.raises(DataError, match=r"rows\.jsonl row 0: no domain: the row has no column 'domain' "
                                        r"\(data\.domain_key\)"):
        loader_from_config(_data(**{**d, "domain_key": "domain"}), tok, "train", process_index=0, process_count=1)
    with pytest.raises(DataError, match=r"^data\.domain_weights: domain 'law' has no rows in data\.train_files "
                                        r"\(domains found: \['code', 'math', 'qa'\]\)$"):
        loader_from_config(_data(**{**d, "domain_weights": {"math": 0.5, "law": 0.5}}), tok, "train",
                           process_index=0, process_count=1)
    with pytest.raises(DataError, match=r"^data\.domain_weights: domain 'qa' takes 12 prompts of each batch of 20 "
                                        r"\(data\.train_batch_size\) but has 9 rows$"):
        loader_from_config(_data(**{**d, "domain_weights": {"math": 0.4, "qa": 0.6}, "train_batch_size": 20}), tok,
                           "train", process_index=0, process_count=1)


@pytest.mark.parametrize("weights, message", [
    ({"a": 0.7, "b": 0.6, "c": 0.1}, "data.domain_weights: the weights before the last domain sum to 1.3, more than "
                                     "the whole batch (the last domain takes the rest)"),
    ({"a": -0.1, "b": 1.0}, "data.domain_weights.a=-0.1 must be a number >= 0"),
    ({"a": "half"}, "data.domain_weights.a='half' must be a number >= 0"),
    ([0.5, 0.5], "data.domain_weights=[0.5, 0.5] must be a mapping {domain: weight}"),
])
def test_bad_weights_are_one_line_errors_naming_the_key(weights, message):
    assert get_key("data.domain_weights").failure(weights) == message


def test_weights_need_not_sum_to_one():
    """ROLL's own RLVR example weighs its domains 0.4, 0.3, 0.1, 0.1: the last takes the rest (0.2)."""
    key = get_key("data.domain_weights")
    assert key.failure({"a": 0.4, "b": 0.3, "c": 0.1, "d": 0.1}) is None and key.failure(None) is None


def test_dynamic_sampling_keeps_each_groups_domain():
    """Groups kept across generation batches carry their own domains (the segments of the per-domain statistics)."""
    c, n = Collected(2, 0), 2
    rollout = {k: np.zeros((4, 3), np.int32) for k in ("prompts", "prompt_mask", "responses", "response_mask",
                                                         "logprobs")}
    rollout["finished"] = np.ones(4, bool)
    c.add(rollout, np.zeros(4), np.array([1]), np.repeat([0, 1], n))
    c.add(rollout, np.zeros(4), np.array([0]), np.repeat([2, 0], n))
    assert c.batch(2)["domain"].tolist() == [1, 1, 2, 2]
