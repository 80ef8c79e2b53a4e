"""Greedy decoding equals ``transformers`` ``generate(do_sample=False)`` token for token (left-padded batches).

Two decode slots for eight samples: every slot is refilled several times, so
these tests check the refill (prompt KV copy, position and mask reset) too.
"""

from __future__ import annotations

import pytest

from rlhf_jax.models import from_pretrained
from rlhf_jax.rollout import eos_token_ids_from_dir, generate

from .rollout_testdata import PAD_ID, build_checkpoint, hf_greedy, ragged_prompts

NEW_TOKENS = 32
SLOTS = 2


@pytest.mark.parametrize("narrow", [False, True], ids=["whole cache", "narrow first loop"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_matches_transformers_on_tiny_checkpoints(kind, narrow, request, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_jax.rollout import scheduler

    # narrow: the first loop runs on a cache of P + 8 columns (a quarter of the response), then widens
    monkeypatch.setattr(scheduler, "NARROW_MIN_TOKENS", NEW_TOKENS // 4 if narrow else 10**9)

    path = request.getfixturevalue(f"{kind}_dir")
    model = from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = ragged_prompts(seed=11, count=7)
    assert len({len(p) for p in prompts}) > 2  # real left padding

    # As stop tokens, tokens that the greedy paths of three prompts emit at different depths: EOS stopping is
    # exercised, and responses end at different steps, so slots refill at different times.
    free = generate(model, prompts, max_new_tokens=NEW_TOKENS, temperature=0.0, eos_token_ids=(), pad_token_id=PAD_ID,
                    max_num_seqs=SLOTS)
    assert all(len(t) == NEW_TOKENS for t in free.tokens)
    assert free.tokens == hf_greedy(hf, prompts, NEW_TOKENS, [NEW_TOKENS + 10_000], PAD_ID)
    eos = (free.tokens[1][6], free.tokens[4][14], free.tokens[6][22])

    ours = generate(model, prompts, max_new_tokens=NEW_TOKENS, temperature=0.0, eos_token_ids=eos, pad_token_id=PAD_ID,
                    max_num_seqs=SLOTS)
    theirs = hf_greedy(hf, prompts, NEW_TOKENS, list(eos), PAD_ID)
    assert ours.tokens == theirs
    assert len({len(t) for t in ours.tokens}) > 2
    assert len(ours.tokens[1]) <= 7 and ours.tokens[1][-1] in eos and ours.finished[1]
    for tokens, done in zip(ours.tokens, ours.finished):
        assert done == (tokens[-1] in eos)
        assert done or len(tokens) == NEW_TOKENS


@pytest.mark.parametrize("kind", ["mistral_window", "qwen2_window", "phi3_window", "gemma2_window",
                                  "gemma3_window"])
def test_greedy_matches_transformers_past_the_sliding_window(kind, tmp_path):
    """Each windowed family (see ``build_checkpoint``): prompts of 3-13 tokens and 24 new tokens run well past
    the 6-token window, in prefill and in decode."""
    import torch
    from transformers import AutoModelForCausalLM

    path = build_checkpoint(kind, str(tmp_path))
    model = from_pretrained(path)
    assert model.config.sliding_window == 6
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = ragged_prompts(seed=12, count=5)
    ours = generate(model, prompts, max_new_tokens=24, temperature=0.0, eos_token_ids=(), pad_token_id=PAD_ID,
                    max_num_seqs=SLOTS)
    assert ours.tokens == hf_greedy(hf, prompts, 24, [24 + 10_000], PAD_ID)


def test_greedy_matches_transformers_on_smollm2_chat(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "What is 12 + 7?",
        "Name three primary colors and explain briefly why they are called primary.",
        "Hi!",
        "Translate 'good morning' into French and Spanish.",
    ]
    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for q in questions
    ]
    assert len({len(p) for p in prompts}) == len(prompts)
    eos = list(eos_token_ids_from_dir(smollm2_dir, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    theirs = hf_greedy(hf, prompts, 24, eos, pad)
    model = from_pretrained(smollm2_dir)
    ours = generate(model, prompts, max_new_tokens=24, do_sample=False, eos_token_ids=eos, pad_token_id=pad,
                    max_num_seqs=SLOTS)
    assert ours.tokens == theirs
    assert "Paris" in tok.decode(ours.tokens[0])
