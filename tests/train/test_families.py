"""A GRPO run (2 steps on 8 fake devices, data x fsdp x tensor = 2 x 2 x 2) trains each newer family.

Each checkpoint is a tiny random transformers model over the vocabulary of the built-in tiny model,
whose tokenizer it borrows.
"""

from __future__ import annotations

import math

import pytest

from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, tiny_hf_checkpoint

FAMILIES = {
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5, sliding_window=6)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=6, attn_logit_softcapping=2.0,
                                                         final_logit_softcapping=3.0, query_pre_attn_scalar=24)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=6, sliding_window_pattern=2)),
}


def _family_checkpoint(kind: str, out: str) -> str:
    config_cls, model_cls, extra = FAMILIES[kind]
    return tiny_hf_checkpoint(config_cls, model_cls, out, **extra)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_grpo_steps_train_each_family(tmp_path, kind):
    model_dir = _family_checkpoint(kind, str(tmp_path / kind))
    cfg = make_config(str(tmp_path / "run"), "grpo", actor_rollout_ref__model__path=model_dir)
    last = Trainer(cfg).fit()
    assert last["training/global_step"] == 2
    assert all(math.isfinite(v) for v in last.values() if isinstance(v, float))
    assert last["actor/grad_norm"] > 0
