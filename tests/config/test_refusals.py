"""Every refusal of a foreign key names the capability rlhf_jax lacks, and the schema still lacks it."""

import pytest

from rlhf_jax.config import limits, schema

PATHS = tuple(key.path for key in schema.KEYS)
REFUSALS = list(limits.refusals())


def test_every_refusal_names_a_limit():
    unnamed = [f"{r.fmt}: {r.their}" for r in REFUSALS if r.limit is None]
    assert not unnamed, ("refused without a limit in config/limits.REFUSED_BECAUSE (map the key if rlhf_jax can do "
                         f"what it asks): {unnamed}")
    unknown = [f"{r.fmt}: {r.their} -> {r.limit}" for r in REFUSALS if r.limit not in limits.LIMITS]
    assert not unknown


def test_every_limit_entry_is_a_refusal_of_its_format():
    refused = {(r.fmt, r.their) for r in REFUSALS}
    stale = [f"{fmt}: {key}" for fmt, table in limits.REFUSED_BECAUSE.items() for key in table
             if (fmt, key) not in refused]
    assert not stale, f"entries of REFUSED_BECAUSE that no rule refuses any more: {stale}"


@pytest.mark.parametrize("name", sorted(limits.LIMITS))
def test_the_schema_still_lacks_what_each_limit_says(name):
    offered = limits.schema_keys_offering(limits.LIMITS[name], PATHS)
    users = sorted(f"{r.fmt}: {r.their}" for r in REFUSALS if r.limit == name)
    assert not offered, (f"the schema now has {offered}, which does what limit {name!r} says rlhf_jax cannot; "
                         f"map these refused keys onto it: {users}")


def test_a_limit_with_no_schema_pattern_is_only_for_values_the_other_trainer_rejects_too():
    assert [name for name, lim in limits.LIMITS.items() if not lim.absent] == ["their_values"]


def test_the_check_fails_when_the_schema_offers_the_capability():
    # a schema with a reward-model offload key (as if its host offload were built) breaks the host_offload limit
    offered = limits.schema_keys_offering(limits.LIMITS["host_offload"],
                                          PATHS + ("reward_model.model.fsdp_config.param_offload",))
    assert offered == ["reward_model.model.fsdp_config.param_offload"]
