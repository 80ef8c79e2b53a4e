"""End-to-end sampler behaviour on a tiny random Llama: log-probs, EOS, lengths, seeds, n, slots, compilation, in-place cache.

Most tests give the sampler fewer decode slots than samples, so they run on
refilled slots.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from flax import nnx

from rlhf_jax.models import from_pretrained
from rlhf_jax.rollout import Sampler, SamplingParams, generate, generate_with_params, left_pad, sampler_for
from rlhf_jax.rollout.scheduler import phase_sizes

from .rollout_testdata import PAD_ID, ragged_prompts


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_sampled_logprobs_equal_teacher_forced(llama_model):
    temperature, R, n = 1.3, 20, 3
    prompts = ragged_prompts(seed=2, count=4)
    out = generate(llama_model, prompts, max_new_tokens=R, temperature=temperature, top_k=30, top_p=0.95, n=n,
                   eos_token_ids=(1,), pad_token_id=PAD_ID, seed=4, max_num_seqs=4)
    b = jax.device_get(out.batch)
    P = b.prompts.shape[1]
    logits = np.asarray(llama_model(out.batch.input_ids(), out.batch.attention_mask()))
    ref = np_log_softmax(logits[:, P - 1 : P + R - 1] / temperature)
    ref = np.take_along_axis(ref, b.responses[:, :, None], axis=2)[:, :, 0]
    live = b.response_mask.astype(bool)
    assert live.sum() > 100
    np.testing.assert_allclose(b.logprobs[live], ref[live], atol=1e-4, rtol=0)
    assert np.all(b.logprobs[~live] == 0)
    # n samples per prompt, prompt-major, from one shared prefill: rows of a prompt differ in their samples
    for i, p in enumerate(prompts):
        rows = b.prompts[i * n : (i + 1) * n]
        assert np.all(rows[:, P - len(p):] == np.asarray(p))
        assert len({tuple(t) for t in out.tokens[i * n : (i + 1) * n]}) > 1


def test_tokens_do_not_depend_on_the_slot_count(llama_model, monkeypatch):
    from rlhf_jax.rollout import scheduler

    monkeypatch.setattr(scheduler, "HALVING_MIN_TOKENS", 24)  # loops of 16, 12, 9, 4, 2, 1 and of 4, 2, 1 slots
    prompts = ragged_prompts(seed=13, count=8)
    kw = dict(max_new_tokens=24, temperature=1.0, top_k=40, n=4, eos_token_ids=(1, 7), pad_token_id=PAD_ID, seed=6)
    few = generate(llama_model, prompts, max_num_seqs=4, **kw)
    many = generate(llama_model, prompts, max_num_seqs=16, **kw)
    lengths = [len(t) for t in few.tokens]
    assert len(set(lengths)) > 3 and min(lengths) < 24 and max(lengths) == 24  # 32 samples of many lengths
    assert few.tokens == many.tokens and few.finished == many.finished
    for a, b in zip(few.logprobs, many.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_eos_masking_ignore_eos_and_exact_length(llama_model):
    prompts = ragged_prompts(seed=5, count=3)
    R = 12
    free = generate(llama_model, prompts, max_new_tokens=R, temperature=0.0, eos_token_ids=(), pad_token_id=PAD_ID,
                    max_num_seqs=2)
    assert [len(t) for t in free.tokens] == [R] * 3 and not any(free.finished)
    eos = free.tokens[0][4]
    stop = generate(llama_model, prompts, max_new_tokens=R, temperature=0.0, eos_token_ids=(eos, 95), pad_token_id=PAD_ID,
                    max_num_seqs=2)
    b = jax.device_get(stop.batch)
    assert b.responses.shape[1] == R
    for row, (full, cut, done) in enumerate(zip(free.tokens, stop.tokens, stop.finished)):
        first = next((i for i, t in enumerate(full) if t in (eos, 95)), None)
        if first is None:
            assert cut == full and not done
            continue
        assert cut == full[: first + 1] and done
        assert np.all(b.response_mask[row, : first + 1] == 1) and np.all(b.response_mask[row, first + 1 :] == 0)
        assert np.all(b.responses[row, first + 1 :] == PAD_ID) and np.all(b.logprobs[row, first + 1 :] == 0)
    assert stop.finished[0] and len(stop.tokens[0]) <= 5
    keep_going = generate(llama_model, prompts, max_new_tokens=R, temperature=0.0, eos_token_ids=(eos,), ignore_eos=True,
                          pad_token_id=PAD_ID, max_num_seqs=2)
    assert keep_going.tokens == free.tokens and not any(keep_going.finished)
    # every row stops on its very first token: the loop exits at once and all responses have length 1
    firsts = tuple({t[0] for t in free.tokens})
    one = generate(llama_model, prompts, max_new_tokens=R, temperature=0.0, eos_token_ids=firsts, pad_token_id=PAD_ID,
                   max_num_seqs=2)
    assert one.tokens == [[t[0]] for t in free.tokens] and all(one.finished)
    single = generate(llama_model, prompts, max_new_tokens=1, temperature=0.0, eos_token_ids=(), pad_token_id=PAD_ID)
    assert single.tokens == [[t[0]] for t in free.tokens] and not any(single.finished)


def test_min_new_tokens_holds_eos_back(llama_model):
    prompts = ragged_prompts(seed=5, count=3)
    R, m = 12, 4
    free = generate(llama_model, prompts, max_new_tokens=R, temperature=0.0, eos_token_ids=(), pad_token_id=PAD_ID)
    # EOS = every row's greedy first token: without min_new_tokens every response would be that one token.
    eos = tuple({t[0] for t in free.tokens})
    for temperature, n in ((0.0, 1), (1.0, 3)):
        params = SamplingParams(max_new_tokens=R, min_new_tokens=m, temperature=temperature, n=n, eos_token_ids=eos,
                                pad_token_id=PAD_ID, seed=3, max_num_seqs=2)
        out = generate_with_params(llama_model, prompts, params)
        b = jax.device_get(out.batch)
        for row, tokens in enumerate(out.tokens):
            assert len(tokens) >= m and not set(tokens[:m]) & set(eos), (temperature, row, tokens)
            stop = next((i for i, t in enumerate(tokens) if t in eos), None)
            assert out.finished[row] == (stop is not None) and (stop is None or stop == len(tokens) - 1)
            assert np.all(np.isfinite(b.logprobs[row, : len(tokens)]))  # log-probs of the unmasked distribution
    # min_new_tokens = response_length: no row can stop early.
    whole = generate_with_params(llama_model, prompts, SamplingParams(
        max_new_tokens=R, min_new_tokens=R, temperature=0.0, eos_token_ids=eos, pad_token_id=PAD_ID))
    assert all(len(t) == R for t in whole.tokens) and not any(whole.finished)
    with pytest.raises(ValueError, match="min_new_tokens must be in"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)


def test_seeds_reproduce_and_differ(llama_model):
    prompts = ragged_prompts(seed=8, count=3)
    kw = dict(max_new_tokens=10, temperature=1.5, n=2, eos_token_ids=(), pad_token_id=PAD_ID)
    a = generate(llama_model, prompts, seed=1, **kw)
    b = generate(llama_model, prompts, seed=1, **kw)
    c = generate(llama_model, prompts, seed=2, **kw)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert a.tokens != c.tokens


def test_compiles_once_per_shape_over_varying_prompts_and_lengths(llama_dir, caplog):
    model = from_pretrained(llama_dir)  # a fresh model object: a fresh sampler
    sampler = sampler_for(model)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=10, eos_token_ids=(1,), pad_token_id=PAD_ID,
                            max_num_seqs=1)
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            generate_with_params(model, [[5, 6, 7], [8] * 9], params)
        assert any("Compiling" in r.getMessage() for r in caplog.records)  # the check can see compilations
        assert sampler.compile_count == 1 and sampler.trace_count == 1
        caplog.clear()
        rng = np.random.default_rng(0)
        with caplog.at_level(logging.WARNING):
            for seed in range(1, 5):  # new prompt lengths in the same buckets, new seeds, new response lengths
                prompts = [[4] * int(rng.integers(1, 17)) for _ in range(2)]
                generate_with_params(model, prompts, params.replace(seed=seed))
        assert not [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    finally:
        jax.config.update("jax_log_compiles", False)
    assert sampler.compile_count == 1 and sampler.trace_count == 1
    generate_with_params(model, [[3] * 20], params)  # prompt bucket 32, batch bucket 1
    assert sampler.compile_count == 2
    generate_with_params(model, [[3] * 20], params.replace(temperature=0.0))  # validation-style settings
    assert sampler.compile_count == 3 and sampler.trace_count == 3


def _copies_of(hlo: str, shape: str) -> list[str]:
    """Copy instructions producing ``shape``, except the one-time fill of a zero-initialised buffer."""
    return [line for line in hlo.splitlines()
            if " copy(" in line and shape in line.split("copy(")[0] and "broadcast" not in line.split("copy(")[1]]


@pytest.mark.parametrize("narrow", [False, True], ids=["whole cache", "narrow first loop"])
def test_kv_cache_is_updated_in_place(llama_model, narrow, monkeypatch):
    """No copy of a slot cache in the compiled program, and temporaries stay under two caches of the first loop."""
    from rlhf_jax.rollout import scheduler

    B, P, R, n = 4, 16, 64, 4
    monkeypatch.setattr(scheduler, "NARROW_MIN_TOKENS", R // 4 if narrow else 10**9)
    monkeypatch.setattr(scheduler, "HALVING_MIN_TOKENS", R)  # the halving tail's loops too
    graphdef, state = nnx.split(llama_model)
    sampler = Sampler(graphdef)
    compiled = sampler.compiled(state, B, P, SamplingParams(max_new_tokens=R, n=n))
    cfg = llama_model.config
    K, S, D = cfg.num_key_value_heads, P + R - 1, cfg.head_dim
    sizes = phase_sizes(B * n, 1, R)
    assert len(sizes) > 1  # the loop shrinks: every slot count's cache is checked
    hlo = compiled.as_text()
    widths = [(M, S) for M in sizes] + ([(sizes[0], P + R // 4)] if narrow else [])
    for M, width in widths:
        for shape in (f"f32[{M},{K},{D},{width}]", f"f32[{M},{K},{width},{D}]"):  # keys (M, K, D, S), values (M, K, S, D)
            assert shape in hlo
            assert not _copies_of(hlo, shape)
    cache_bytes = cfg.num_hidden_layers * 2 * sizes[0] * S * K * D * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * cache_bytes


def test_sampler_rejects_bad_inputs(llama_model):
    graphdef, state = nnx.split(llama_model)
    sampler = Sampler.for_model(llama_model)
    ids, mask = left_pad([[5, 6]], 16, 1, PAD_ID)
    with pytest.raises(ValueError, match="context"):
        sampler.generate(state, ids, mask, SamplingParams(max_new_tokens=250))
    with pytest.raises(ValueError, match="differs"):
        sampler.generate(state, ids, mask[:, :8], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="context minus rollout.response_length"):
        generate(llama_model, [[5] * 220], max_new_tokens=50, eos_token_ids=(), pad_token_id=PAD_ID)
    # a 200-token prompt would bucket to 256 > 256 - 50: the bucket is capped so that it still fits
    out = generate(llama_model, [[5] * 200], max_new_tokens=50, temperature=0.0, eos_token_ids=(), pad_token_id=PAD_ID)
    assert out.batch.prompts.shape[1] == 206 and len(out.tokens[0]) == 50
