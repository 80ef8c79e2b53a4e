"""Reward-model scoring matches transformers' LlamaForSequenceClassification (< 1e-4)."""

import string

import numpy as np
import pytest
import torch

from rlhf_jax.config import base_config
from rlhf_jax.rewards.reward_model import RewardModelScorer, decode_responses

TOL = 1e-4
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"


def _write_char_tokenizer(out_dir):
    """A character-level tokenizer (ids < 128) with its own chat template, saved next to the RM weights."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + list(string.printable[:95]))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    return tok


@pytest.fixture
def rm(hf_checkpoint):
    path, torch_model = hf_checkpoint("llama_seq_cls", seed=3)
    tok = _write_char_tokenizer(path)
    return path, torch_model, tok


def _hf_score(torch_model, ids):
    with torch.no_grad():
        return float(torch_model(torch.tensor([ids], dtype=torch.long)).logits[0, 0])


def test_score_ids_matches_transformers(rm):
    path, torch_model, _ = rm
    scorer = RewardModelScorer.from_pretrained(path, micro_batch_size=3)
    rng = np.random.default_rng(0)
    lengths = [7, 19, 1, 12, 19]  # 5 rows: the second micro-batch gets a filler row
    T = max(lengths)
    ids = np.zeros((len(lengths), T), np.int32)
    mask = np.zeros((len(lengths), T), np.int32)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = rng.integers(1, 128, n)
        mask[b, T - n:] = 1
    got = scorer.score_ids(ids, mask)
    want = np.array([_hf_score(torch_model, ids[b, T - n:].tolist()) for b, n in enumerate(lengths)])
    assert got.dtype == np.float32 and got.shape == (5,)
    assert np.abs(want).max() > 1e-3  # a meaningful, non-degenerate comparison
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


def test_score_texts_with_rm_template_and_policy_decode(rm, smollm2_dir):
    """Policy (SmolLM2) response ids are decoded, then re-templated with the RM's own tokenizer."""
    from transformers import AutoTokenizer

    path, torch_model, rm_tok = rm
    policy = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = ["What is 2+3?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
               "Name a colour."]
    responses = ["2+3 = 5.", "Hello there", "Blue, like the sea and the sky on a clear summer day."]
    enc = [policy(r, add_special_tokens=False)["input_ids"] + [policy.eos_token_id] for r in responses]
    R = max(map(len, enc)) + 2
    resp_ids = np.full((3, R), policy.pad_token_id, np.int32)
    resp_mask = np.zeros((3, R), np.int32)
    for b, e in enumerate(enc):
        resp_ids[b, : len(e)] = e
        resp_mask[b, : len(e)] = 1
    decoded = decode_responses(policy, resp_ids, resp_mask)
    assert decoded == responses

    scorer = RewardModelScorer.from_pretrained(path, micro_batch_size=2)
    got = scorer.score_texts(prompts, decoded)
    want = []
    for p, r in zip(prompts, responses):
        msgs = ([{"role": "user", "content": p}] if isinstance(p, str) else p) + [{"role": "assistant", "content": r}]
        ref_ids = rm_tok.apply_chat_template(msgs, tokenize=True)
        ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids
        assert scorer.encode([p], [r])[0] == list(ref_ids)
        want.append(_hf_score(torch_model, list(ref_ids)))
    np.testing.assert_allclose(got, np.array(want), rtol=0, atol=TOL)


def test_max_length_keeps_the_end_and_from_config(rm):
    path, torch_model, rm_tok = rm
    cfg = base_config().reward_model  # the key table's defaults, with what this test varies
    cfg.model.path, cfg.micro_batch_size_per_gpu, cfg.max_length = path, 4, 24
    scorer = RewardModelScorer.from_config(cfg)
    prompt, response = "x" * 40, "the end"
    ids = scorer.encode([prompt], [response])[0]
    full = rm_tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                                      tokenize=False)
    full_ids = rm_tok(full, add_special_tokens=False)["input_ids"]
    assert ids == full_ids[-24:]
    np.testing.assert_allclose(scorer.score_texts([prompt], [response]), [_hf_score(torch_model, ids)], atol=TOL)
