"""Every schema default equals verl's (its generated ppo_trainer.yaml) or is listed, with the reason, in
config/verl_defaults.py."""

import os

import yaml

from rlhf_jax.config import schema
from rlhf_jax.config.interpolation import has_reference
from rlhf_jax.config.verl_defaults import DIFFERENCES
from rlhf_jax.config.yaml_import import coerce

VERL = os.path.join(os.path.dirname(__file__), "verl", "_generated_ppo_trainer.yaml")


def _verl_values() -> dict:
    """{schema key: verl's literal value} for the schema keys verl's file sets without a reference."""
    with open(VERL) as fh:
        mapping = yaml.safe_load(fh)
    found = {}
    for key in schema.KEYS:
        node, present = mapping, True
        for part in key.path.split("."):
            if not (isinstance(node, dict) and part in node):
                present = False
                break
            node = node[part]
        if present and not isinstance(node, dict) and not has_reference(node):
            found[key.path] = None if node is None else coerce(key, node)
    return found


def test_defaults_equal_verls_or_are_listed_with_a_reason():
    verl = _verl_values()
    assert len(verl) > 100  # the comparison covers most of the schema
    differing = {path: value for path, value in verl.items() if value != schema.get_key(path).default}
    assert set(differing) == set(DIFFERENCES), (
        f"not listed: {sorted(set(differing) - set(DIFFERENCES))}; listed but equal: "
        f"{sorted(set(DIFFERENCES) - set(differing))}")
    for path, (verl_value, why) in DIFFERENCES.items():
        assert differing[path] == verl_value, path
        assert why.strip(), path


def test_kl_cov_coefficient_is_verls():
    assert schema.get_key("actor_rollout_ref.actor.policy_loss.ppo_kl_coef").default == 0.1
