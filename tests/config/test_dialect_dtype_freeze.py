"""ATorch's per-model ``model_params.torch_dtype`` and the TRL-based trainer's ``freeze_config`` map onto the
model's dtype keys and ``actor_rollout_ref.actor.freeze.*``; what cannot agree is refused by name."""

import os

import pytest

from rlhf_jax.config.yaml_import import load_yaml

HERE = os.path.join(os.path.dirname(__file__), "dialects")


def test_atorch_torch_dtype_is_the_models_dtype():
    cfg = load_yaml(os.path.join(HERE, "atorch_ppo.yaml"))
    assert (cfg.actor_rollout_ref.model.dtype, cfg.actor_rollout_ref.model.compute_dtype) == ("bfloat16", "bfloat16")
    base = "model:\n  actor:\n    model_path: /m\n    model_params:\n      torch_dtype: {}\n"
    for written, dtype in [("torch.float16", "float16"), ("bf16", "bfloat16"), ("float32", "float32")]:
        m = load_yaml(base.format(written)).actor_rollout_ref.model
        assert (m.dtype, m.compute_dtype) == (dtype, dtype)
    plain = load_yaml("model:\n  actor:\n    model_path: /m\n").actor_rollout_ref.model
    assert (plain.dtype, plain.compute_dtype) == ("float32", "float32")  # transformers' default load dtype
    # one model for actor and critic: its dtype is the policy's
    shared = load_yaml("model:\n  actor_critic:\n    model_path: /m\n    model_params:\n      torch_dtype: bfloat16\n")
    assert shared.actor_rollout_ref.model.dtype == "bfloat16" and shared.critic.shared_trunk


def test_atorch_other_roles_dtype_must_agree_with_the_actors():
    head = "model:\n  actor:\n    model_path: /m\n    model_params:\n      torch_dtype: bfloat16\n"
    ok = load_yaml(head + "  critic:\n    model_path: /m\n    model_params:\n      torch_dtype: torch.bfloat16\n")
    assert ok.actor_rollout_ref.model.compute_dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"model\.reward_model\.model_params\.torch_dtype='float16' differs from the "
                                         r"actor's bfloat16"):
        load_yaml(head + "  reward_model:\n    model_path: /rm\n    model_params:\n      torch_dtype: float16\n")
    with pytest.raises(ValueError, match=r"model\.ref_model\.model_params\.torch_dtype='bfloat16' differs from the "
                                         r"actor's float32"):
        load_yaml("model:\n  actor:\n    model_path: /m\n  ref_model:\n    model_path: /m\n    model_params:\n"
                  "      torch_dtype: bfloat16\n")


def test_trainer_config_freeze_config_is_the_actors_freeze():
    cfg = load_yaml(os.path.join(HERE, "Trainer_config.yaml"))
    f = cfg.actor_rollout_ref.actor.freeze
    assert (f.freeze_emb, f.freeze_ln, f.freeze_attn, f.freeze_ff, f.freeze_other) == (True, False, True, True, False)
    assert tuple(f.layers_not_to_freeze) == (1,)
    f = load_yaml("reward_config:\n  reward_model_name: rm\nfreeze_config:\n  freeze_other: true\n"
                  "  layers_not_to_freeze: ['0', 2]\n").actor_rollout_ref.actor.freeze
    assert f.freeze_other and not f.freeze_emb and tuple(f.layers_not_to_freeze) == (0, 2)
