"""Routing replay of a Mixture-of-Experts actor (actor_rollout_ref.actor.router_replay.mode) in GRPO steps of a tiny
Qwen3-MoE checkpoint whose sampler holds bfloat16 weights (rollout.weight_dtype), so that sampler and trainer route
some tokens differently.

R3: the batch the passes read carries the sampler's expert ids, and the update's forward (the one
``steps.actor_update`` runs) uses exactly them for every response token but the last; routing natively instead
differs on some. The sampler/trainer log-prob mismatch falls with replay on (measured here, 2 steps, 8 fake CPU
devices, training/rollout_probs_diff_mean per step: disabled 1.01e-4, 4.96e-5; R3 2.98e-5, 4.09e-5; R2 1.01e-4,
5.80e-5: R2 replays in the update only, so its old-log-prob pass routes as without replay).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, tiny_hf_checkpoint

BF16_SAMPLER = {"actor_rollout_ref.rollout.weight_dtype": "bfloat16",
                "actor_rollout_ref.model.use_remove_padding": False,
                "data.max_response_length": 8, "trainer.total_training_steps": 2}


def _trainer(tmp_path, model_dir: str, mode: str) -> Trainer:
    return Trainer(make_config(str(tmp_path / mode), "grpo", **BF16_SAMPLER, **{
        "actor_rollout_ref.model.path": model_dir, "actor_rollout_ref.actor.router_replay.mode": mode}))


def _steps(trainer: Trainer, count: int = 2) -> list[dict]:
    return [trainer.train_on(next(trainer.loader), step) for step in range(count)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE checkpoint (8 experts, top 2, its second layer dense) over the tiny tokenizer."""
    return tiny_hf_checkpoint("Qwen3MoeConfig", "Qwen3MoeForCausalLM", str(tmp_path_factory.mktemp("moe") / "m"),
                              num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1)


def test_r3_update_routes_every_response_token_as_the_sampler_did(tmp_path, moe_dir):
    trainer = _trainer(tmp_path, moe_dir, "R3")
    prepared = []
    run = trainer.prepare

    def keep(*args, **kwargs):  # the real Preparer; the test keeps what it returns
        prepared.append(run(*args, **kwargs))
        return prepared[-1]

    trainer.prepare = keep
    try:
        _steps(trainer, 1)
        batch = prepared[0].batch
        model = trainer.actor.model()
        forward = jax.jit(lambda m, i, a, r: m.hidden_states(i, a, routes=r, record_routes=True)[1])
        replayed = np.asarray(forward(model, batch.input_ids, batch.attention_mask, batch.routed_experts))
        native = np.asarray(forward(model, batch.input_ids, batch.attention_mask, None))
    finally:
        trainer.close()
    sampled = np.asarray(batch.routed_experts)
    R = batch.responses.shape[1]
    mask = np.asarray(batch.response_mask).astype(bool)
    fed = mask.copy()  # every response token but the last is fed back to the sampler
    fed[np.arange(len(mask)), mask.sum(1) - 1] = False
    assert fed.sum() > 0 and (sampled[:, -R:][fed] >= 0).all() and (sampled[:, -R:][~mask] == -1).all()
    np.testing.assert_array_equal(replayed[:, -R:][fed], sampled[:, -R:][fed])
    prompt = np.asarray(batch.attention_mask)[:, :-R].astype(bool)
    np.testing.assert_array_equal(replayed[:, :-R][prompt], sampled[:, :-R][prompt])
    # without replay the bf16 sampler and the f32 trainer disagree on some route
    assert (native[:, -R:][fed] != sampled[:, -R:][fed]).any(axis=(-1, -2)).sum() > 0


def test_replay_lowers_the_sampler_trainer_log_prob_mismatch(tmp_path, moe_dir):
    diffs = {}
    for mode in ("disabled", "R3", "R2"):
        trainer = _trainer(tmp_path, moe_dir, mode)
        try:
            diffs[mode] = [m["training/rollout_probs_diff_mean"] for m in _steps(trainer)]
        finally:
            trainer.close()
    print(diffs)
    assert diffs["R3"][0] < 0.5 * diffs["disabled"][0]  # the first step samples the same tokens in both runs
    assert np.mean(diffs["R3"]) < np.mean(diffs["disabled"])
