"""The score and advantage shaping keys (config/keys_shaping.py): each bad value or combination stops finalize with
one line naming the key."""

from __future__ import annotations

import pytest

from rlhf_jax.config import base_config, finalize


def _reinforce():
    cfg = base_config()
    cfg.algorithm.adv_estimator = "reinforce"
    cfg.actor_rollout_ref.rollout.n = 4
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    for section in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref):
        key = "ppo_micro_batch_size_per_gpu" if section is cfg.actor_rollout_ref.actor else \
            "log_prob_micro_batch_size_per_gpu"
        setattr(section, key, 4)
    return cfg


def _set(path, value):
    def mutate(cfg):
        *parents, leaf = path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    return mutate


@pytest.mark.parametrize("mutate,pattern", [
    (_set("algorithm.reward_clip", 0.0), r"^algorithm\.reward_clip=0\.0 must be > 0"),
    (_set("algorithm.advantage_clip", -1.0), r"^algorithm\.advantage_clip=-1\.0 must be > 0"),
    (_set("algorithm.reward_norm.mean", "running"), r"^algorithm\.reward_norm\.mean='running' is not valid"),
    (_set("algorithm.sample_mask.difficulty_high", 1.5), r"^algorithm\.sample_mask\.difficulty_high=1\.5 must be in"),
    (lambda c: (_set("algorithm.sample_mask.difficulty", True)(c), _set("algorithm.sample_mask.difficulty_low", 0.9)(c),
                _set("algorithm.sample_mask.difficulty_high", 0.5)(c)),
     r"^algorithm\.sample_mask\.difficulty_low=0\.9 must be below difficulty_high=0\.5"),
    (lambda c: (_set("algorithm.sample_mask.difficulty", True)(c), _set("actor_rollout_ref.rollout.n", 1)(c)),
     r"^algorithm\.sample_mask\.difficulty compares the samples of one prompt"),
    (lambda c: (_set("algorithm.reward_norm.std", "group")(c), _set("actor_rollout_ref.rollout.n", 1)(c)),
     r"^algorithm\.reward_norm\.std=group compares the samples of one prompt"),
    (lambda c: (_set("algorithm.adv_estimator", "gae")(c), _set("algorithm.whiten_advantages", True)(c)),
     r"^algorithm\.whiten_advantages: adv_estimator=gae whitens its advantages already"),
    (lambda c: (_set("algorithm.reward_norm.mean", "batch")(c),
                _set("actor_rollout_ref.rollout.multi_turn.per_turn_rewards", True)(c)),
     r"^algorithm\.reward_norm normalises one score per response"),
])
def test_shaping_rejections_name_the_key(mutate, pattern):
    cfg = _reinforce()
    finalize(cfg, num_devices=1)  # valid before the change
    mutate(cfg)
    with pytest.raises(ValueError, match=pattern):
        finalize(cfg, num_devices=1)


def test_shaping_settings_pass_finalize():
    cfg = _reinforce()
    for path, value in (("algorithm.reward_norm.mean", "group"), ("algorithm.reward_norm.std", "batch"),
                        ("algorithm.reward_clip", 10.0), ("algorithm.advantage_clip", 2.0),
                        ("algorithm.whiten_advantages", True), ("algorithm.sample_mask.truncated", True),
                        ("algorithm.sample_mask.difficulty", True), ("algorithm.sample_mask.difficulty_low", 0.1)):
        _set(path, value)(cfg)
    out = finalize(cfg, num_devices=1)
    assert (out.algorithm.reward_clip, out.algorithm.sample_mask.difficulty_low) == (10.0, 0.1)
