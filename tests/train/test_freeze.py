"""Frozen parameter groups (actor_rollout_ref.actor.freeze.*): no gradient, no optimizer state, unchanged weights."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from rlhf_jax.train import freeze
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config


def _flat(state) -> dict:
    return {p: np.asarray(v.get_value() if hasattr(v, "get_value") else v) for p, v in nnx.to_flat_state(state)}


def test_groups_of_a_llama_state():
    from rlhf_jax.models import TASK_CAUSAL_LM, from_hf_dict
    from rlhf_jax.models.hf_import import build_abstract

    cfg = from_hf_dict(dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            tie_word_embeddings=False, max_position_embeddings=64, rms_norm_eps=1e-6))
    _, state = nnx.split(build_abstract(cfg, TASK_CAUSAL_LM))
    groups = {"/".join(map(str, p)): freeze.group_of(p) for p, _ in nnx.to_flat_state(state)}
    assert groups["model/embed_tokens"] == "emb"
    assert groups["lm_head"] == "other"
    assert groups["model/norm/weight"] == "ln"
    assert groups["model/layers/1/self_attn/q_norm/weight"] == "ln"  # a norm inside attention is a norm
    assert groups["model/layers/0/input_layernorm/weight"] == "ln"
    assert groups["model/layers/0/self_attn/k_proj"] == "attn"
    assert groups["model/layers/1/mlp/down_proj"] == "ff"
    spec = freeze.FreezeSpec(frozenset({"attn", "ff"}), layers_not_to_freeze=(1,))
    trained = freeze.check(spec, state, cfg.num_hidden_layers)
    assert not trained(("model", "layers", 0, "self_attn", "q_proj"))
    assert trained(("model", "layers", 1, "self_attn", "q_proj"))
    assert trained(("model", "layers", 0, "input_layernorm", "weight"))


@pytest.mark.parametrize("packed", [True, False])
def test_frozen_parameters_are_bit_identical_after_three_steps(tmp_path, packed):
    cfg = make_config(str(tmp_path / "run"), "grpo", **{
        "trainer.total_training_steps": 3, "actor_rollout_ref.actor.optim.lr": 1e-2,
        "actor_rollout_ref.model.use_remove_padding": packed,
        "actor_rollout_ref.actor.freeze.freeze_emb": True, "actor_rollout_ref.actor.freeze.freeze_attn": True,
        "actor_rollout_ref.actor.freeze.freeze_ln": True,
        "actor_rollout_ref.actor.freeze.layers_not_to_freeze": (1,)})
    trainer = Trainer(cfg)
    before = _flat(trainer.actor.state())
    trainer.fit()
    after = _flat(trainer.actor.state())
    trained = freeze.trainable_filter(freeze.FreezeSpec(frozenset({"emb", "attn", "ln"}), (1,)))
    frozen_paths = [p for p in before if not trained(p)]
    trained_paths = [p for p in before if trained(p)]
    assert frozen_paths and trained_paths
    assert any(freeze.layer_of(p) == 1 and freeze.group_of(p) == "attn" for p in trained_paths)
    for p in frozen_paths:
        np.testing.assert_array_equal(after[p], before[p], err_msg=str(p))
    changed = [p for p in trained_paths if not np.array_equal(after[p], before[p])]
    assert set(changed) == set(trained_paths), set(trained_paths) - set(changed)
    # The optimizer holds moments for the trained parameters only.
    mu = [s for s in jax.tree.leaves(trainer.actor.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)][0].mu
    assert set(_flat(mu)) == set(trained_paths)
    assert set(_flat(trainer.actor.params)) == set(trained_paths)


@pytest.mark.parametrize("overrides, key", [
    ({"freeze_other": True}, "actor_rollout_ref.actor.freeze.freeze_other"),  # tied embeddings: no lm_head
    ({"freeze_attn": True, "layers_not_to_freeze": (7,)}, "actor_rollout_ref.actor.freeze.layers_not_to_freeze"),
    ({"layers_not_to_freeze": (0,)}, "actor_rollout_ref.actor.freeze.layers_not_to_freeze"),
    ({"freeze_emb": True, "freeze_ln": True, "freeze_attn": True, "freeze_ff": True}, "actor_rollout_ref.actor.freeze"),
])
def test_a_freeze_setting_that_names_nothing_stops_before_loading(tmp_path, overrides, key):
    cfg = make_config(str(tmp_path / "run"), "grpo",
                      **{f"actor_rollout_ref.actor.freeze.{k}": v for k, v in overrides.items()})
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Trainer(cfg)
