"""The actor's and the critic's offload keys in whole runs: the same steps, bit for bit, with the arrays in host memory.

``actor_rollout_ref.actor.fsdp_config.param_offload`` / ``optimizer_offload`` and the critic's
(``critic.model.fsdp_config.*``) keep parameters and optimizer state in ``pinned_host`` memory between programs. A
GRPO run (padded and packed layouts, and LoRA, whose frozen base is what moves to host memory) and a PPO run with a
critic log the same metrics and end with the same parameters as the run without offload; a run resumed from a
checkpoint continues exactly; verl's command line with both actor keys runs a step.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlhf_jax.train.offload import HOST_MEMORY
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, read_metrics, run_main
from tests.train.test_new_policy_losses_cli import ONE_STEP
from tests.train.test_resume import _assert_same_rows

A = "actor_rollout_ref.actor.fsdp_config."
C = "critic.model.fsdp_config."
ACTOR_OFFLOAD = {A + "param_offload": True, A + "optimizer_offload": True}


def _kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _run(out_dir: str, steps: int = 3, **overrides) -> Trainer:
    trainer = Trainer(make_config(out_dir, **{"trainer.total_training_steps": steps, **overrides}))
    trainer.fit()
    return trainer


def _assert_same_runs(want: Trainer, got: Trainer, want_dir: str, got_dir: str) -> None:
    want_rows, got_rows = read_metrics(want_dir), read_metrics(got_dir)
    assert len(got_rows) == len(want_rows) == 3
    for a, b in zip(want_rows, got_rows):
        _assert_same_rows(a, b)
        assert {k: v for k, v in a.items() if k.startswith(("actor/", "critic/"))} == \
            {k: v for k, v in b.items() if k.startswith(("actor/", "critic/"))}  # bit for bit
    for a, b in zip(jax.tree.leaves((want.actor.state(), want.actor.opt_state)),
                    jax.tree.leaves((got.actor.state(), got.actor.opt_state))):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


@pytest.mark.parametrize("layout", ["padded", "packed", "lora"])
def test_grpo_with_the_actor_offloaded_equals_the_run_without(tmp_path, layout):
    overrides = {"actor_rollout_ref.model.use_remove_padding": layout != "padded"}
    if layout == "lora":
        overrides.update({"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.actor.optim.lr": 1e-2})
    want = _run(str(tmp_path / "device"), **overrides)
    got = _run(str(tmp_path / "host"), **overrides, **ACTOR_OFFLOAD)
    _assert_same_runs(want, got, str(tmp_path / "device"), str(tmp_path / "host"))
    assert _kinds(got.actor.opt_state) == {HOST_MEMORY}
    if layout == "lora":  # the adapters stay on the devices, the base (shared with the reference) is in host memory
        assert _kinds(got.actor.params) == {"device"} and _kinds(got.actor.frozen) == {HOST_MEMORY}
    else:
        assert _kinds(got.actor.state()) == {HOST_MEMORY}
    assert _kinds(got.ref.state()) == ({HOST_MEMORY} if layout == "lora" else {"device"})
    assert read_metrics(str(tmp_path / "host"))[-1]["actor/grad_norm"] > 0


def test_ppo_with_the_critic_offloaded_equals_the_run_without(tmp_path):
    overrides = {"algorithm.adv_estimator": "gae", "critic.enable": True}
    want = _run(str(tmp_path / "device"), **overrides)
    got = _run(str(tmp_path / "host"), **overrides, **{C + "param_offload": True, C + "optimizer_offload": True})
    _assert_same_runs(want, got, str(tmp_path / "device"), str(tmp_path / "host"))
    assert _kinds((got.critic.params, got.critic.opt_state)) == {HOST_MEMORY}
    assert _kinds(got.actor.params) == {"device"}
    for a, b in zip(jax.tree.leaves((want.critic.params, want.critic.opt_state)),
                    jax.tree.leaves((got.critic.params, got.critic.opt_state))):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    assert "critic/vf_loss" in read_metrics(str(tmp_path / "host"))[-1]


def test_a_run_resumed_with_offload_continues_exactly(tmp_path):
    full_dir, split_dir = str(tmp_path / "full"), str(tmp_path / "split")
    full = _run(full_dir, 3, **{"trainer.save_freq": 2}, **ACTOR_OFFLOAD)
    _run(split_dir, 2, **{"trainer.save_freq": 2}, **ACTOR_OFFLOAD)
    resumed = _run(split_dir, 3, **{"trainer.save_freq": 2}, **ACTOR_OFFLOAD)
    full_rows, split_rows = read_metrics(full_dir), read_metrics(split_dir)
    assert [r["step"] for r in split_rows] == [1, 2, 3]
    _assert_same_rows(full_rows[2], split_rows[2])
    # the restored parameters and optimizer state went back to host memory, with the values saved
    assert _kinds((resumed.actor.params, resumed.actor.opt_state)) == {HOST_MEMORY}
    for a, b in zip(jax.tree.leaves((full.actor.params, full.actor.opt_state)),
                    jax.tree.leaves((resumed.actor.params, resumed.actor.opt_state))):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_verl_command_line_with_both_actor_offload_keys_runs_a_step(tmp_path):
    out = tmp_path / "run"
    proc = run_main([*ONE_STEP, "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                     "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
                     "actor_rollout_ref.ref.fsdp_config.param_offload=True", f"trainer.default_local_dir={out}"],
                    devices=1)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "param_offload" not in proc.stderr  # honoured: not listed among the ignored keys
    (row,) = read_metrics(str(out))
    assert np.isfinite(row["actor/pg_loss"]) and np.isfinite(row["actor/grad_norm"])


def test_offload_of_a_critic_on_the_actors_trunk_names_the_actors_key(tmp_path):
    from rlhf_jax.config import finalize

    cfg = make_config(str(tmp_path), **{"algorithm.adv_estimator": "gae", "critic.enable": True,
                                        "critic.shared_trunk": True, C + "param_offload": True})
    with pytest.raises(ValueError, match=r"critic.model.fsdp_config.param_offload=True applies to a separate critic"):
        finalize(cfg, num_devices=8, check_paths=False)
