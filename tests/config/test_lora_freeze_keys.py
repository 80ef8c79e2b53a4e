"""verl's LoRA keys and the freeze section as they arrive from YAML files and finalize."""

from __future__ import annotations

import jax
import pytest

from rlhf_jax.config import finalize, load_yaml


def test_verl_lora_keys_set_the_actor_adapters():
    cfg = load_yaml("actor_rollout_ref:\n  model:\n    lora_rank: 8\n    lora_alpha: 16\n    target_modules: all-linear\n"
                    "    exclude_modules: null\n    lora_adapter_path: null\n"
                    "critic:\n  model:\n    lora_rank: 0\n    lora_alpha: 16\n    target_modules: all-linear\n")
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (8, 16.0, ("all-linear",))
    cfg = load_yaml("actor_rollout_ref:\n  model:\n    target_modules: [q_proj, v_proj]\n")
    assert cfg.actor_rollout_ref.model.target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize("text, message", [
    ("critic:\n  model:\n    lora_rank: 8\n", r"critic\.model\.lora_rank=8 .*LoRA is implemented for the actor only"),
    ("actor_rollout_ref:\n  model:\n    exclude_modules: [down_proj]\n", r"exclude_modules.*not implemented"),
])
def test_lora_features_we_lack_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        load_yaml(text)


@pytest.mark.parametrize("yaml_text, message", [
    ("actor_rollout_ref:\n  model:\n    lora_rank: -1\n", r"actor_rollout_ref\.model\.lora_rank=-1 must be >= 0"),
    ("actor_rollout_ref:\n  model:\n    lora_adapter_path: /x\n", r"lora_adapter_path is set but .*lora_rank=0"),
])
def test_lora_ranges_are_checked_by_finalize(yaml_text, message):
    with pytest.raises(ValueError, match=message):
        finalize(load_yaml(yaml_text), num_devices=jax.device_count(), check_paths=False)


def test_freeze_section_from_yaml():
    cfg = load_yaml("actor_rollout_ref:\n  actor:\n    freeze:\n      freeze_emb: true\n      layers_not_to_freeze: [0, 3]\n")
    freeze = cfg.actor_rollout_ref.actor.freeze
    assert freeze.freeze_emb and not freeze.freeze_attn and freeze.layers_not_to_freeze == (0, 3)
