"""Keys mean what they mean in verl: save_freq / test_freq <= 0 is "never", None (the default) "at the end"."""

import os

import pytest

from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, read_metrics


def _has_val(row: dict) -> bool:
    return any(k.startswith("val-core/") for k in row)


def test_minus_one_saves_nothing_and_never_validates(tmp_path):
    out = str(tmp_path / "run")
    Trainer(make_config(out, **{"trainer.save_freq": -1, "trainer.test_freq": -1,
                                "trainer.save_hf_checkpoint": "last"})).fit()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and not any(_has_val(r) for r in rows)
    assert not os.path.exists(os.path.join(out, "checkpoints")) or not os.listdir(os.path.join(out, "checkpoints"))
    assert not os.path.exists(os.path.join(out, "hf"))


def test_defaults_save_and_validate_at_the_last_step_only(tmp_path):
    out = str(tmp_path / "run")
    cfg = make_config(out, **{"trainer.total_training_steps": 3, "trainer.val_before_train": True})
    cfg.trainer.save_freq, cfg.trainer.test_freq = None, None  # the schema defaults (the recipe sets numbers)
    Trainer(cfg).fit()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [_has_val(r) for r in rows] == [True, False, False, True]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["3"]


def test_every_n_steps_and_at_the_last(tmp_path):
    out = str(tmp_path / "run")
    Trainer(make_config(out, **{"trainer.total_training_steps": 3, "trainer.save_freq": 2,
                                "trainer.test_freq": 2})).fit()
    rows = read_metrics(out)
    assert [_has_val(r) for r in rows] == [False, True, True]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2", "3"]


def test_remax_runs_with_its_greedy_baseline(tmp_path):
    import math

    out = str(tmp_path / "run")
    trainer = Trainer(make_config(out, **{"algorithm.adv_estimator": "remax", "trainer.total_training_steps": 3}))
    trainer.fit()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["timing_s/gen_max"] > 0  # the greedy rollout ran
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/mean"))
    # Advantages are reward-to-go minus the greedy score: with the dense reward they are not all zero.
    assert any(r["critic/advantages/max"] != r["critic/advantages/min"] for r in rows)


def test_full_kl_is_rejected_before_anything_is_built(tmp_path):
    import pytest

    from rlhf_jax.train.setup import prepare

    for overrides, key in (({"actor_rollout_ref.actor.use_kl_loss": True,
                             "actor_rollout_ref.actor.kl_loss_type": "full"}, "actor_rollout_ref.actor.kl_loss_type"),
                           ({"algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": "full"},
                            "algorithm.kl_penalty")):
        with pytest.raises(ValueError, match=f"{key}=full .*not supported.*low_var_kl"):
            prepare(make_config(str(tmp_path), **overrides))
    # Unused, it changes nothing and is accepted (verl's files carry a kl_loss_type whether or not the loss is on).
    prepare(make_config(str(tmp_path), **{"actor_rollout_ref.actor.use_kl_loss": False,
                                          "actor_rollout_ref.actor.kl_loss_type": "full"}))


# Prompts whose first character is an even digit always score 1, the others score 0 or 1 by response length:
# groups of the first kind have no variance and must be dropped.
HALF_FLAT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(extra_info["index"]) % 2 == 0:
        return {"score": 1.0, "acc": 1.0}
    return {"score": float(len(solution_str) % 2), "acc": float(len(solution_str) % 2)}
"""


def test_dapo_filter_groups_fills_the_batch_with_varied_groups(tmp_path):
    import numpy as np

    from rlhf_jax.rollout.dynamic_sampling import Collected, varied_groups

    reward = tmp_path / "reward.py"
    reward.write_text(HALF_FLAT_REWARD)
    out = str(tmp_path / "run")
    trainer = Trainer(make_config(out, recipe="dapo", **{
        "custom_reward_function.path": str(reward), "algorithm.filter_groups.metric": "acc",
        "trainer.total_training_steps": 2, "actor_rollout_ref.rollout.n": 4, "data.max_response_length": 8,
        "reward_model.overlong_buffer.enable": False}))
    seen = []
    original = trainer.producer._rollout

    def recording(pb, *args, **kwargs):  # the real rollout; records which prompts each batch held
        seen.append(list(pb.extra_info))
        return original(pb, *args, **kwargs)

    trainer.producer._rollout = recording
    trainer.fit()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/num_gen_batches"] >= 2  # half the groups are flat: one batch of 4 prompts is never enough
        assert 0 < r["critic/score/mean"] < 1  # only varied groups trained: never all-1 groups
    assert len(seen) == sum(r["train/num_gen_batches"] for r in rows)
    # The pieces: a flat group is dropped; kept groups are cut to the batch, prompts padded to one width.
    assert list(varied_groups(np.array([1, 1, 0, 1, 2, 2]), 2)) == [1]
    c = Collected(n=2, pad_token_id=0)
    rollout = {"prompts": np.ones((4, 3), np.int32), "prompt_mask": np.ones((4, 3), np.int32),
               "responses": np.full((4, 2), 7), "response_mask": np.ones((4, 2)), "logprobs": np.zeros((4, 2)),
               "finished": np.ones(4, bool)}
    c.add(rollout, np.arange(4.0), np.array([1]))
    c.add({**rollout, "prompts": np.ones((4, 5), np.int32), "prompt_mask": np.ones((4, 5), np.int32)},
          np.arange(4.0) + 10, np.array([0, 1]))
    batch = c.batch(2)
    assert batch["prompts"].shape == (4, 5) and list(batch["scores"]) == [2, 3, 10, 11]
    assert batch["prompt_mask"][:2, :2].sum() == 0  # left padding of the shorter prompts


GDPO_HALF_FLAT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    fmt = 1.0 if int(extra_info["index"]) % 2 == 0 else float(len(solution_str) % 2)
    return {"score": fmt, "acc": fmt, "format_reward": fmt, "length_reward": float(len(solution_str))}
"""


def test_gdpo_with_dynamic_sampling_keeps_each_kept_rows_components(tmp_path):
    """GDPO's reward components travel with the groups dynamic sampling keeps: every kept row's are the reward
    function's values of that row's response (its length; its format, which is its score), then the step trains."""
    import math

    import numpy as np

    from rlhf_jax.parallel.hosts import to_local
    from rlhf_jax.rewards.reward_model import decode_responses
    from rlhf_jax.train import metrics as M

    reward = tmp_path / "reward.py"
    reward.write_text(GDPO_HALF_FLAT_REWARD)
    trainer = Trainer(make_config(str(tmp_path / "run"), recipe="dapo", **{
        "custom_reward_function.path": str(reward), "algorithm.filter_groups.metric": "acc",
        "algorithm.adv_estimator": "gdpo", "algorithm.gdpo_reward_keys": ("format_reward", "length_reward"),
        "trainer.total_training_steps": 1, "actor_rollout_ref.rollout.n": 4, "data.max_response_length": 8,
        "reward_model.overlong_buffer.enable": False}))
    try:
        scored = trainer.producer.produce(next(trainer.loader), 0)
        assert scored.draws >= 2  # half the groups are flat: one batch of 4 prompts is never enough
        components, scores = to_local(scored.components), to_local(scored.scores)
        texts = decode_responses(trainer.c.tokenizer, to_local(scored.rollout.responses),
                                 to_local(scored.rollout.response_mask))
        np.testing.assert_array_equal(components[:, 1], [len(t) for t in texts])
        np.testing.assert_array_equal(components[:, 0], scores)
        assert len(set(components[:, 1].tolist())) > 1  # rows of several lengths: a shifted row would show
        metrics = trainer.learn(scored, M.Timer(), 0)
    finally:
        trainer.close()
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])


# Each prompt scores its own index (plus 0.5 for an odd response length when the index is odd); the groups of
# even indices are flat.
INDEX_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    i = int(extra_info["index"])
    if i % 2 == 0:
        return {"score": float(i), "acc": 1.0}
    return {"score": i + 0.5 * (len(solution_str) % 2), "acc": float(len(solution_str) % 2)}
"""


def test_remax_with_dynamic_sampling_baselines_each_kept_group_with_its_own_prompt(tmp_path):
    """ReMax's greedy baselines with dynamic sampling: every drawn batch's prompts get their greedy responses, and
    a kept group keeps its own: each row's baseline is its prompt's index (the whole part of its score) plus the
    greedy response's 0 or 0.5, whichever batch the group came from."""
    import math

    import numpy as np

    from rlhf_jax.parallel.hosts import to_local
    from rlhf_jax.train import metrics as M

    reward = tmp_path / "reward.py"
    reward.write_text(INDEX_REWARD)
    trainer = Trainer(make_config(str(tmp_path / "run"), recipe="dapo", **{
        "custom_reward_function.path": str(reward), "algorithm.filter_groups.metric": "acc",
        "algorithm.adv_estimator": "remax", "trainer.total_training_steps": 1, "actor_rollout_ref.rollout.n": 4,
        "data.max_response_length": 8, "reward_model.overlong_buffer.enable": False}))
    try:
        scored = trainer.producer.produce(next(trainer.loader), 0)
        assert scored.draws >= 2 and scored.metrics["timing_s/gen_max"] > 0
        scores, baselines = to_local(scored.scores), to_local(scored.baselines)
        np.testing.assert_array_equal(np.floor(baselines), np.floor(scores))
        assert set((baselines - np.floor(baselines)).tolist()) <= {0.0, 0.5}
        assert len(set(np.floor(scores).tolist())) > 1  # several prompts: a group given another's baseline would show
        metrics = trainer.learn(scored, M.Timer(), 0)
    finally:
        trainer.close()
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])


def test_dynamic_sampling_keeps_r3_routes_beside_their_tokens():
    """R3's expert ids (rows, P + R, layers, k) of batches with other prompt and response widths: the prompt's
    columns are left-padded and the response's right-padded with the tokens, with -1 (routed by no expert)."""
    import numpy as np

    from rlhf_jax.rollout.dynamic_sampling import Collected

    def part(rows: int, P: int, R: int, first: int) -> dict:
        ids = np.arange(first, first + rows)[:, None] * 100 + np.arange(P + R)[None, :]  # row * 100 + column
        return {"prompts": ids[:, :P], "prompt_mask": np.ones((rows, P), np.int32), "responses": ids[:, P:],
                "response_mask": np.ones((rows, R), np.int32), "logprobs": np.zeros((rows, R)),
                "finished": np.ones(rows, bool),
                "routed_experts": np.broadcast_to(ids[:, :, None, None], (rows, P + R, 3, 2)).astype(np.int32)}

    c = Collected(n=2, pad_token_id=0)
    c.add(part(4, 3, 5, first=0), np.zeros(4), np.array([1]))  # rows 2, 3: narrow prompt, wide response
    c.add(part(4, 6, 2, first=10), np.zeros(4), np.array([0]))  # rows 10, 11: wide prompt, narrow response
    batch = c.batch(2)
    routes, tokens = batch["routed_experts"], np.concatenate([batch["prompts"], batch["responses"]], axis=1)
    assert routes.shape == (4, 6 + 5, 3, 2)
    real = np.concatenate([batch["prompt_mask"], batch["response_mask"]], axis=1).astype(bool)
    np.testing.assert_array_equal(routes[..., 0, 0][real], tokens[real])  # each token's own routes
    assert (routes[~real] == -1).all() and real.sum() == 2 * (3 + 5) + 2 * (6 + 2)


def test_rollout_and_validation_dumps(tmp_path):
    import json

    import numpy as np

    out, rollouts, vals = str(tmp_path / "run"), str(tmp_path / "rollouts"), str(tmp_path / "val")
    Trainer(make_config(out, **{"trainer.rollout_data_dir": rollouts, "trainer.validation_data_dir": vals,
                                "trainer.test_freq": 2})).fit()
    rows = read_metrics(out)

    def read(path):
        with open(path) as f:
            return [json.loads(line) for line in f]

    assert sorted(os.listdir(rollouts)) == ["1.jsonl", "2.jsonl"] and os.listdir(vals) == ["2.jsonl"]
    for step, row in zip((1, 2), rows):
        dumped = read(os.path.join(rollouts, f"{step}.jsonl"))
        assert len(dumped) == 8 and {d["step"] for d in dumped} == {step}  # 4 prompts x 2 samples
        # verl's fields, and the version of the weights that sampled the row (on-policy: the previous step's)
        assert set(dumped[0]) == {"input", "output", "gts", "score", "step", "weight_version"}
        assert {d["weight_version"] for d in dumped} == {step - 1}
        assert np.mean([d["score"] for d in dumped]) == pytest.approx(row["critic/score/mean"], rel=1e-5)
    val = read(os.path.join(vals, "2.jsonl"))
    assert set(val[0]) == {"input", "output", "gts", "score", "step"}
    assert len(val) == 4 and np.mean([d["score"] for d in val]) == pytest.approx(
        rows[-1]["val-core/arithmetic/reward/mean@1"], rel=1e-5)


def test_rollout_correction_reweights_and_rejects_in_the_actor_update(tmp_path):
    import math

    # On one machine the sampler's and the trainer's log-probs agree (ratios ~ 1): token-level TIS (verl's older
    # tis_imp_ratio_cap) keeps the update and reports weights of ~1 ...
    out = str(tmp_path / "tis")
    Trainer(make_config(out, **{"actor_rollout_ref.actor.tis_imp_ratio_cap": 2.0})).fit()
    for r in read_metrics(out):
        assert abs(r["rollout_corr/rollout_is_mean"] - 1.0) < 1e-3 and r["rollout_corr/rollout_is_ratio_fraction_high"] == 0
        assert abs(r["rollout_corr/kl"]) < 1e-3 and r["actor/pg_loss"] != 0 and r["actor/grad_norm"] > 0
    # ... while a rejection band that excludes ratio 1 removes every token from the loss: no gradient at all.
    out = str(tmp_path / "rs")
    Trainer(make_config(out, **{"algorithm.rollout_correction.rollout_rs": "token",
                                "algorithm.rollout_correction.rollout_rs_threshold": 1.5,
                                "algorithm.rollout_correction.rollout_rs_threshold_lower": 1.2})).fit()
    for r in read_metrics(out):
        assert r["rollout_corr/rollout_rs_masked_fraction"] == 1.0 and r["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0
        assert r["actor/pg_loss"] == 0 and r["actor/grad_norm"] == 0
        assert r["response_length/mean"] > 0 and math.isfinite(r["actor/entropy"])  # metrics of what was sampled
