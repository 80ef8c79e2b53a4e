"""Which of verl's releases name each key (rlhf_jax/config/verl_releases.json, read from verl's release tags)."""

from __future__ import annotations

from rlhf_jax.config import verl_releases
from rlhf_jax.config.docs import render_markdown
from rlhf_jax.config.verl_releases import RELEASES, flat_paths, releases_of


def test_flat_paths_names_sections_and_leaves():
    assert flat_paths({"a": {"b": 1, "c": {"d": None}}, "e": 2}) == {"a", "a.b", "a.c", "a.c.d", "e"}


def test_ranges_of_consecutive_releases(monkeypatch):
    table = {"x": ["v0.1", "v0.2", "v0.3.0.post1", "v0.7.0", "v0.9.0"], "y": list(RELEASES)}
    monkeypatch.setattr(verl_releases, "table", lambda: table)
    assert releases_of("x") == "v0.1-v0.3.0.post1, v0.7.0, v0.9.0"
    assert releases_of("y") == "v0.1-v0.9.0"
    assert releases_of("z") == ""


def test_the_table_knows_where_verl_moved_keys():
    assert releases_of("algorithm.adv_estimator") == "v0.1-v0.9.0"
    # the reward function's path moved under reward.* in v0.7.1; the older place is still read
    assert releases_of("reward.custom_reward_function.path") == "v0.7.1-v0.9.0"
    assert releases_of("custom_reward_function.path").startswith("v0.3.0.post1")
    assert releases_of("actor_rollout_ref.actor.policy_loss.loss_mode") == "v0.4.1-v0.9.0"
    assert releases_of("mesh.fsdp") == ""  # rlhf_jax's own


def test_config_reference_shows_the_releases():
    md = render_markdown()
    assert "| `algorithm.adv_estimator` | `'gae'` | str | v0.1-v0.9.0 |" in md
    assert "| `reward.custom_reward_function.path` | v0.7.1-v0.9.0 | `custom_reward_function.path` | sets it |" in md
