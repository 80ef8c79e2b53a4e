"""SamplingParams from the config schema's rollout section, EOS ids from a checkpoint, and bucketing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlhf_jax.config import base_config, finalize
from rlhf_jax.rollout import SamplingParams, bucket_batch, bucket_length, eos_token_ids_from_dir, left_pad


def test_from_config_reads_train_and_validation_settings():
    cfg = base_config()
    r = cfg.actor_rollout_ref.rollout
    r.temperature, r.top_k, r.top_p, r.n, r.response_length, r.seed = 0.8, 20, 0.95, 4, 48, 7
    r.val_kwargs.temperature, r.val_kwargs.n, r.val_kwargs.do_sample = 0.0, 1, False
    train = SamplingParams.from_config(r, eos_token_ids=[2, 5], pad_token_id=2)
    assert (train.temperature, train.top_k, train.top_p, train.n, train.max_new_tokens, train.seed) == (0.8, 20, 0.95, 4, 48, 7)
    assert train.eos_token_ids == (2, 5) and train.pad_token_id == 2 and not train.greedy
    val = SamplingParams.from_config(r, validation=True)
    assert val.greedy and val.n == 1 and val.max_new_tokens == 48 and val.top_p == r.val_kwargs.top_p
    assert val.logprob_temperature == 1.0
    assert train.static_key() == train.replace(seed=123).static_key()
    assert train.max_num_seqs is None and val.max_num_seqs is None
    r.max_num_seqs = 32
    assert SamplingParams.from_config(r).max_num_seqs == 32
    assert SamplingParams.from_config(r, validation=True).max_num_seqs == 32


def test_from_config_reads_the_defaults_finalize_filled_and_errors():
    cfg = base_config()
    cfg.data.max_response_length, cfg.trainer.seed = 24, 3  # rollout.response_length and seed default to these
    r = finalize(cfg, num_devices=1, check_paths=False).actor_rollout_ref.rollout
    p = SamplingParams.from_config(r)
    assert p.max_new_tokens == 24 and p.seed == 3
    for bad in (dict(top_p=0.0), dict(temperature=-1.0), dict(top_k=-2), dict(n=0), dict(max_new_tokens=0),
                dict(max_num_seqs=0)):
        with pytest.raises(ValueError, match="actor_rollout_ref.rollout"):
            SamplingParams(**{"max_new_tokens": 4, **bad})


def test_eos_ids_are_collected_from_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))

    class Tok:
        eos_token_id = 9

    assert eos_token_ids_from_dir(str(tmp_path), Tok()) == (9, 7, 2)
    assert eos_token_ids_from_dir(str(tmp_path)) == (7, 2)


def test_buckets_bound_the_number_of_shapes():
    lengths = {bucket_length(n) for n in range(1, 300)}
    assert lengths == {16, 32, 64, 128, 256, 512}
    assert bucket_length(100, maximum=120) == 120
    with pytest.raises(ValueError, match="max_prompt_length"):
        bucket_length(130, maximum=120)
    assert [bucket_batch(b, multiple=4) for b in (1, 3, 5, 8, 9)] == [4, 4, 8, 8, 16]
    assert bucket_batch(3) == 4


def test_left_pad_places_prompts_right_and_fills_extra_rows():
    ids, mask = left_pad([[5, 6, 7], [9]], length=5, batch=3, pad_token_id=0)
    np.testing.assert_array_equal(ids, [[0, 0, 5, 6, 7], [0, 0, 0, 0, 9], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [0, 0, 0, 0, 1]])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        left_pad([[1], []], length=4, batch=2, pad_token_id=0)
