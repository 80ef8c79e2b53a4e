"""Routing replay of a Mixture-of-Experts actor (actor_rollout_ref.actor.router_replay.mode) in one GRPO step of a
tiny Qwen3-MoE checkpoint whose sampler holds bfloat16 weights (rollout.weight_dtype), so that sampler and trainer
route some tokens differently. One device, 2 prompts x 2 samples, two mini-batches (rows 0, 2 and 1, 3: each
packed afresh, apart from its prompt's other sample); three runs in all (R3 padded, R3 packed, R2 packed), each read
by several tests.

R3: the update's forward (the one ``steps.actor_update`` / ``packed_steps.actor_grads`` runs on the mini-batch or
the packed micro-batches it was given) routes every response token the sampler fed back, and every prompt token,
to the experts the sampler recorded (``RolloutBatch.routed_experts``, read straight from the rollout); routing
natively instead differs on some. R2 (packed): the old-log-prob pass's recorded routes, scattered back from the
packed rows, are the padded forward's native routes at every real token, and the update replays them. The
sampler/trainer log-prob mismatch of the step falls with R3 (training/rollout_probs_diff_mean; R2's old-log-prob
pass routes natively, so its value is the one without replay).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlhf_jax.train import layout as layout_module
from rlhf_jax.train.packed_steps import packed_hidden
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, tiny_hf_checkpoint

SMALL_BF16_SAMPLER = {
    "actor_rollout_ref.rollout.weight_dtype": "bfloat16",
    "data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 1,
    "data.max_response_length": 8, "trainer.total_training_steps": 1,
    "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "trainer.n_gpus_per_node": 1,
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE checkpoint (8 experts, top 2, its second layer dense) over the tiny tokenizer."""
    return tiny_hf_checkpoint("Qwen3MoeConfig", "Qwen3MoeForCausalLM", str(tmp_path_factory.mktemp("moe") / "m"),
                              num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1)


_forward = jax.jit(lambda m, i, a, r: m.hidden_states(i, a, routes=r, record_routes=True)[1])
_packed_forward = jax.jit(lambda m, micro: packed_hidden(m, micro, record_routes=True)[1])


def _update_routes(model, updates: list, N: int, R: int):
    """The expert ids the packed update's forward uses on the batch's rows, (response routes (N, R, S, K), prompt's
    last token (N, S, K)), and the same routed natively, read at the positions of its logit lists: the state
    predicting response token t >= 1 is token t - 1's, the one predicting token 0 the prompt's last (one shard).
    ``updates``: (the mini-batch's rows of the batch, its micro-batches) of each optimizer step."""
    out = {}
    for replay in (True, False):
        response, last = None, None
        for rows, micro in ((rows, micro) for rows, micros in updates for micro in micros):
            used = np.asarray(_packed_forward(model, micro if replay else
                                              {k: v for k, v in micro.items() if k != "routes"}))
            used = used.reshape(-1, *used.shape[2:])
            if response is None:
                response = np.full((N, R) + used.shape[1:], -1, np.int32)
                last = np.full((N,) + used.shape[1:], -1, np.int32)
            for at, cell in zip(np.asarray(micro["logit_positions"]), np.asarray(micro["logit_targets"])):
                if cell < 0:
                    continue
                local, t = divmod(int(cell), R)
                row = rows[local]
                if t == 0:
                    last[row] = used[at]
                else:
                    response[row, t - 1] = used[at]
        out[replay] = (response, last)
    return out


def _run(tmp_path, model_dir: str, mode: str, packed: bool, **overrides) -> dict:
    """One step; what the tests read of it, computed with the weights the step's passes used."""
    cfg = make_config(str(tmp_path / f"{mode}-{packed}"), "grpo", **{
        **SMALL_BF16_SAMPLER, "actor_rollout_ref.model.path": model_dir,
        "actor_rollout_ref.actor.router_replay.mode": mode, "actor_rollout_ref.model.use_remove_padding": packed,
        **overrides})
    trainer, seen, updates = Trainer(cfg), {}, []
    prepare, micros_of, update_padded = trainer.prepare, layout_module.Packer.micros, layout_module.Padded.update

    def keep_prepared(scored, *args, **kwargs):  # the real Preparer; the test reads its input and output
        prepared = prepare(scored, *args, **kwargs)
        batch, model = prepared.batch, trainer.actor.model()  # the weights before the update
        seen.update(rollout=np.asarray(scored.rollout.routed_experts) if mode == "R3" else None,
                    prompt_mask=np.asarray(scored.rollout.prompt_mask), response_mask=np.asarray(batch.response_mask),
                    routed=np.asarray(batch.routed_experts), attention_mask=np.asarray(batch.attention_mask),
                    native=np.asarray(_forward(model, batch.input_ids, batch.attention_mask, None)))
        return prepared

    def keep_micros(packer, plan, rows=None, **kwargs):  # the real packer; the test keeps the update's micro-batches
        out = micros_of(packer, plan, rows, **kwargs)
        if plan.name == "update_actor":
            updates.append((rows, out))
        return out

    def keep_mini_batch(padded, role, loss, mb, rows=None, rng=None):  # the real padded update; the test keeps mb
        updates.append((rows, mb))
        return update_padded(padded, role, loss, mb, rows, rng)

    trainer.prepare = keep_prepared
    layout_module.Packer.micros, layout_module.Padded.update = keep_micros, keep_mini_batch
    try:
        metrics = trainer.train_on(next(trainer.loader), 0)
        model = trainer.actor.model()  # replayed ids do not depend on the weights; native ones are compared within
        N, R = seen["response_mask"].shape
        assert len(updates) == 2  # two mini-batches, one epoch
        if packed:
            seen["update"] = _update_routes(model, updates, N, R)
            # what the memory plan compiles (for the largest batch) of a pass that replays (R3's reference) or
            # records (R2's old log-probs) routes: the program that pass runs
            name = "ref" if mode == "R3" else "old_log_prob"
            compiled = trainer.compile_pass(name, trainer.plans[name])
            seen["planned"] = (jax.tree.structure(compiled.args_info[0][2]), compiled.out_info)
        else:  # the routes the padded update's forward uses, on the batch's rows
            seen["update"] = {}
            for replay in (True, False):
                used = np.full(seen["routed"].shape, -2, np.int32)
                for rows, mb in updates:
                    used[rows] = np.asarray(_forward(model, mb.input_ids, mb.attention_mask,
                                                     mb.routed_experts if replay else None))
                seen["update"][replay] = used
    finally:
        layout_module.Packer.micros, layout_module.Padded.update = micros_of, update_padded
        trainer.close()
    return {"metrics": metrics, **seen}


def _dynamic_on_rollout_devices(tmp_path) -> dict:
    """DAPO's dynamic sampling (half the groups score flat, so a step draws two prompt batches or more, of their
    own prompt and response widths) sampled on a rollout device of its own."""
    from tests.train.test_verl_semantics import HALF_FLAT_REWARD

    reward = tmp_path / "reward.py"
    reward.write_text(HALF_FLAT_REWARD)
    return {"mesh.rollout_devices": 1, "trainer.n_gpus_per_node": 2, "algorithm.filter_groups.enable": True,
            "algorithm.filter_groups.metric": "acc", "custom_reward_function.path": str(reward)}


def _tool_conversations() -> dict:
    """Multi-turn rollouts: a tool call after every turn (up to 3 turns of 4 tokens), its response appended; the
    sampler keeps the float32 weights, so that the trainer's native routes show where each recorded one belongs."""
    from tests.train.test_multi_turn_train import MT  # registers the test tool and its parser

    return {"actor_rollout_ref.rollout.weight_dtype": None, MT + "enable": True, MT + "tools": ("test_digits",), MT + "format": "test_first_two_turns",
            MT + "max_assistant_turns": 3, MT + "max_tokens_per_turn": 4, "data.max_response_length": 40,
            "data.prompt_template": "native", "data.max_prompt_length": 32}


def _workflow_episodes(tmp_path) -> dict:
    """A workflow agent's episodes (tests/train/test_multi_turn_train.py's AGENT: two client calls, the agent's own
    messages between them), the sampler in float32 as in ``_tool_conversations``."""
    from tests.train.test_multi_turn_train import AGENT, MT

    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    return {"actor_rollout_ref.rollout.weight_dtype": None, MT + "enable": True, MT + "workflow": f"{path}:solve",
            MT + "workflow_args": {"calls": 2}, MT + "max_tokens_per_turn": 4, "data.max_response_length": 120,
            "data.prompt_template": "native", "data.max_prompt_length": 64}


@pytest.fixture(scope="module")
def runs(moe_dir, tmp_path_factory):
    """Each (mode, packed, variant) run once for the module, on first use; variant "dynamic": see
    ``_dynamic_on_rollout_devices``, "multi_turn": ``_tool_conversations``, "workflow": ``_workflow_episodes``."""
    done: dict = {}

    def get(mode: str, packed: bool, variant: str = "") -> dict:
        if (mode, packed, variant) not in done:
            tmp = tmp_path_factory.mktemp("runs")
            overrides = {"dynamic": _dynamic_on_rollout_devices, "multi_turn": lambda _: _tool_conversations(),
                         "workflow": _workflow_episodes, "": lambda _: {}}[variant](tmp)
            done[mode, packed, variant] = _run(tmp, moe_dir, mode, packed, **overrides)
        return done[mode, packed, variant]

    return get


def _fed(response_mask: np.ndarray) -> np.ndarray:
    """Every response token but the last is fed back to the sampler (and so routed by it)."""
    mask = response_mask.astype(bool)
    fed = mask.copy()
    fed[np.arange(len(mask)), mask.sum(1) - 1] = False
    assert fed.sum() > 0
    return fed


@pytest.mark.parametrize("packed,variant", [(False, ""), (True, ""), (True, "dynamic")],
                         ids=["padded", "packed", "dynamic-sampling-on-rollout-devices"])
def test_r3_update_routes_every_fed_token_as_the_sampler_did(runs, packed, variant):
    """With dynamic sampling the routes are those of the kept groups, padded (-1) to the widest batch's widths
    with the tokens, and they come over from the rollout device with the batch."""
    run = runs("R3", packed, variant)
    if variant:
        assert run["metrics"]["train/num_gen_batches"] >= 2
    sampled, prompt = run["rollout"], run["prompt_mask"].astype(bool)  # (N, P + R, S, K) from the sampler
    P = prompt.shape[1]
    fed = _fed(run["response_mask"])
    R = fed.shape[1]
    assert (sampled[:, P:P + R][fed] >= 0).all() and (sampled[:, P:][~fed] == -1).all()
    if packed:
        (response, last), (native, _) = run["update"][True], run["update"][False]
        np.testing.assert_array_equal(last, sampled[:, P - 1])  # the prompt's last token
        micro, _ = run["planned"]  # the planned reference pass takes the micro-batch's routes
        assert "routes" in str(micro), micro
    else:
        used, native = run["update"][True], run["update"][False]
        width_p = used.shape[1] - R  # the padded batch keeps the prompt's last width_p columns
        np.testing.assert_array_equal(used[:, :width_p][prompt[:, P - width_p:]], sampled[:, :P][prompt])
        response, native = used[:, width_p:], native[:, width_p:]
    np.testing.assert_array_equal(response[fed], sampled[:, P:P + R][fed])
    # without replay the bf16 sampler and the f32 trainer disagree on some route
    assert (native[fed] != sampled[:, P:P + R][fed]).any(axis=(-1, -2)).sum() > 0


@pytest.mark.parametrize("variant", ["multi_turn", "workflow"])
def test_r3_multi_turn_update_routes_every_token_of_the_conversations_as_the_sampler_did(runs, variant):
    """Every token a conversation held (the prompt, the assistant turns, the tool responses between them, and the
    last token too: each went through the cache) is routed in the update as the sampler routed it, at its own
    column: with the sampler's (float32) weights the trainer routes natively to the same experts. A workflow's
    episode (the agent's messages between its client's calls) likewise, from its last call."""
    run = runs("R3", False, variant)
    if variant == "multi_turn":
        assert run["metrics"]["multi_turn/tool_calls/mean"] >= 1
    else:
        assert run["metrics"]["multi_turn/num_turns/mean"] == 2  # two client calls per episode
    assert 0 < run["metrics"]["multi_turn/masked_token_fraction"] < 1  # tool responses / the agent's messages
    sampled, P, R = run["rollout"], run["prompt_mask"].shape[1], run["response_mask"].shape[1]
    used, native = run["update"][True], run["native"]  # native: the batch routed with the sampler's weights
    width_p = used.shape[1] - R  # the padded batch keeps the prompt's last width_p columns
    expected = np.concatenate([sampled[:, P - width_p:P], sampled[:, P:P + R]], axis=1)
    real = run["attention_mask"].astype(bool)
    assert (expected[real] >= 0).all() and (expected[~real] == -1).all()
    np.testing.assert_array_equal(used[real], expected[real])
    agree = (native[real] == expected[real]).all(axis=(-1, -2)).mean()
    assert agree > 0.97, agree  # a near tie may fall the other way in another program; a shifted column would not


def test_r2_packed_records_native_routes_and_the_update_replays_them(runs):
    run = runs("R2", True)
    recorded, real = run["routed"], run["attention_mask"].astype(bool)  # (N, P + R, S, K) from the packed pass
    # the packed old-log-prob pass routed every real token (prompts shared by two samples included) as the padded
    # forward does with the same weights, and its ids landed on that token's cell
    np.testing.assert_array_equal(recorded[real], run["native"][real])
    assert (recorded[~real] == -1).all()
    fed = _fed(run["response_mask"])
    R = fed.shape[1]
    P = recorded.shape[1] - R
    response, last = run["update"][True]
    np.testing.assert_array_equal(response[fed], recorded[:, P:][fed])
    np.testing.assert_array_equal(last, recorded[:, P - 1])
    _, (logp, used) = run["planned"]  # the planned old-log-prob pass returns the ids it used at each position
    assert used.dtype == np.int32 and used.shape[2:] == recorded.shape[2:], (logp, used)


def test_r3_lowers_the_sampler_trainer_log_prob_mismatch(runs):
    # R2's old-log-prob pass routes natively: the same pass, weights and samples as without replay
    without = runs("R2", True)["metrics"]["training/rollout_probs_diff_mean"]
    r3 = runs("R3", True)["metrics"]["training/rollout_probs_diff_mean"]
    # the same step's first prompt batch, the groups that vary of two batches or more
    r3_dynamic = runs("R3", True, "dynamic")["metrics"]["training/rollout_probs_diff_mean"]
    print({"without replay": without, "R3": r3, "R3, dynamic sampling on a rollout device": r3_dynamic})
    assert r3 < 0.5 * without and r3_dynamic < 0.5 * without
