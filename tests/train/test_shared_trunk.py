"""A value head on the actor's trunk (critic.shared_trunk): the model, the joint loss, a PPO run, export, bad input."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

from rlhf_jax.models import TASK_CAUSAL_LM_VALUE, TASK_TOKEN_VALUE, CausalLMWithValue, from_pretrained
from rlhf_jax.train import steps
from rlhf_jax.train.setup import prepare
from rlhf_jax.train.trainer import Trainer
from rlhf_jax.types import TrainBatch
from tests.conftest import left_padded_batch
from tests.train.helpers import loss_specs, make_config, read_metrics


def _shared_and_separate(path):
    """The shared model, and a separate critic over the same checkpoint holding the shared model's head."""
    shared = from_pretrained(path, task=TASK_CAUSAL_LM_VALUE)
    critic = from_pretrained(path, task=TASK_TOKEN_VALUE)
    critic.score[...] = shared.score[...]
    critic.score_bias[...] = jnp.asarray(np.random.default_rng(1).normal(size=(1,)), jnp.float32)
    shared.score_bias[...] = critic.score_bias[...]
    return shared, critic


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_log_probs_and_values_equal_the_separate_models(hf_checkpoint, kind):
    path, _ = hf_checkpoint(kind)
    shared, critic = _shared_and_separate(path)
    actor = from_pretrained(path)  # the plain causal LM of the same checkpoint
    rng = np.random.default_rng(0)
    ids, mask = left_padded_batch(rng, actor.config.vocab_size, [7, 5, 9])
    responses = ids[:, -3:]
    args = (jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(responses), 0.7, True)
    logp_shared, ent_shared = steps.response_log_probs(shared, *args)
    logp_actor, ent_actor = steps.response_log_probs(actor, *args)
    np.testing.assert_allclose(np.asarray(logp_shared), np.asarray(logp_actor), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent_shared), np.asarray(ent_actor), rtol=0, atol=1e-6)
    values_shared = steps.response_values(shared, jnp.asarray(ids), jnp.asarray(mask), 3)
    values_critic = steps.response_values(critic, jnp.asarray(ids), jnp.asarray(mask), 3)
    np.testing.assert_allclose(np.asarray(values_shared), np.asarray(values_critic), rtol=1e-6, atol=1e-6)
    # The head is a real linear map of the trunk's states (float64 reference).
    hidden = np.asarray(shared.hidden_states(jnp.asarray(ids), jnp.asarray(mask)), np.float64)[:, -4:-1]
    expected = hidden @ np.asarray(shared.score[...], np.float64)[:, 0] + float(shared.score_bias[...][0])
    np.testing.assert_allclose(np.asarray(values_shared), expected, rtol=1e-5, atol=1e-5)
    assert np.std(expected) > 1e-3  # not a constant


def test_the_joint_loss_is_the_sum_of_both_losses_from_one_forward_pass(hf_checkpoint, monkeypatch):
    path, _ = hf_checkpoint("llama")
    shared, _ = _shared_and_separate(path)
    rng = np.random.default_rng(2)
    N, R = 4, 3
    ids, mask = left_padded_batch(rng, shared.config.vocab_size, [6, 8, 5, 7])
    responses = ids[:, -R:]
    response_mask = np.ones((N, R), np.int32)
    response_mask[0, -1] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "responses": responses, "response_mask": response_mask,
             "old_log_probs": rng.normal(-2, 0.3, (N, R)), "advantages": rng.normal(0, 1, (N, R)),
             "values": rng.normal(0, 0.5, (N, R)), "returns": rng.normal(0, 1, (N, R))}
    batch = TrainBatch(**{k: jnp.asarray(v, jnp.float32 if v.dtype == np.float64 else jnp.int32)
                          for k, v in batch.items()})
    critic_spec = dataclasses.replace(loss_specs()[1], cliprange_value=0.2)
    spec = loss_specs(value=critic_spec, vf_coef=0.3)[0]
    graphdef, params = nnx.split(shared)

    calls = []
    original = CausalLMWithValue.hidden_states

    def counted(self, *a, **k):
        calls.append(1)
        return original(self, *a, **k)

    monkeypatch.setattr(CausalLMWithValue, "hidden_states", counted)
    tx = optax.sgd(0.0)
    _, _, metrics = steps.actor_update(graphdef, tx, spec, params, nnx.State({}), tx.init(params), batch,
                                       jax.random.key(0), n_micro=1)
    assert len(calls) == 1  # log-probs and values from one forward pass

    # The same terms computed separately: the actor loss of the plain spec, the value loss of the head's values.
    mask_f = batch.response_mask.astype(jnp.float32)
    logp, ent = steps.response_log_probs(shared, batch.input_ids, batch.attention_mask, batch.responses, 1.0,
                                         True)
    den, den_plain = steps.actor_denominators(spec, mask_f)
    _, actor_metrics = steps.actor_loss(dataclasses.replace(spec, value=None), logp, ent, batch, mask_f, den,
                                        den_plain, jax.random.key(0))
    vpreds = steps.response_values(shared, batch.input_ids, batch.attention_mask, R)
    vden = steps.value_denominator(spec, mask_f)
    vloss, _ = steps.critic_loss(critic_spec, vpreds, batch, mask_f, vden)
    assert float(metrics["critic/vf_loss"]) == pytest.approx(float(vloss), rel=1e-5)
    assert float(metrics["actor/pg_loss"]) == pytest.approx(float(actor_metrics["actor/pg_loss"]), rel=1e-5, abs=1e-7)
    assert float(vloss) > 1e-3


def test_ppo_with_a_shared_trunk_trains_exports_and_packs_like_padded(tmp_path):
    settings = {"critic.shared_trunk": True, "critic.optim.lr": 1e-5, "trainer.total_training_steps": 3,
                "trainer.save_hf_checkpoint": "last"}
    out = str(tmp_path / "packed")
    trainer = Trainer(make_config(out, recipe="ppo", **settings))
    assert trainer.critic is None and trainer.actor.task == TASK_CAUSAL_LM_VALUE
    before = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(trainer.actor.params)}
    trainer.fit()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("actor/pg_loss", "critic/vf_loss", "critic/vpred_mean", "actor/grad_norm", "critic/score/mean"):
            assert np.isfinite(r[key]), key
    after = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(trainer.actor.params)}
    assert not np.array_equal(before[("score",)], after[("score",)])  # the head learns ...
    trunk = [k for k in before if k[0] == "model"]
    assert any(not np.array_equal(before[k], after[k]) for k in trunk)  # ... and so does the trunk
    # Exported as the causal LM plus the value head (TRL's names).
    export = os.path.join(out, "hf", "global_step_3")
    head = load_file(os.path.join(export, "value_head.safetensors"))
    np.testing.assert_array_equal(head["v_head.summary.weight"], after[("score",)].T)
    plain = from_pretrained(export)
    assert plain.task == "causal_lm" and not hasattr(plain, "score")

    padded = str(tmp_path / "padded")
    Trainer(make_config(padded, recipe="ppo", **settings, **{"actor_rollout_ref.model.use_remove_padding": False,
                                                          "critic.model.use_remove_padding": False})).fit()
    for a, b in zip(rows, read_metrics(padded)):
        for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/vpred_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)


def test_lora_trains_the_adapters_and_the_value_head_and_exports_the_head(tmp_path):
    """Under LoRA the value head trains beside the adapters (the base stays frozen), the reference is the causal LM
    over the frozen arrays, and both the run's export and ``rlhf_jax.export`` from its checkpoint write the head."""
    from rlhf_jax.export import export
    from rlhf_jax.models import lora

    out = str(tmp_path / "run")
    trainer = Trainer(make_config(out, recipe="ppo", **{
        "critic.shared_trunk": True, "critic.optim.lr": 1e-5, "trainer.total_training_steps": 2,
        "trainer.save_freq": 2, "trainer.save_hf_checkpoint": "last", "actor_rollout_ref.model.lora_rank": 4,
        "actor_rollout_ref.model.lora_alpha": 8.0, "actor_rollout_ref.actor.optim.lr": 2e-2,
        "actor_rollout_ref.actor.use_kl_loss": True}))
    head = {("score",), ("score_bias",)}
    before = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(trainer.actor.state())}
    trained = {k for k, _ in nnx.to_flat_state(trainer.actor.params)}
    assert trained == {k for k in before if lora.is_adapter(k)} | head
    ref = trainer.ref.state()
    assert not head & {k for k, _ in nnx.to_flat_state(ref)}
    assert {id(x) for x in jax.tree.leaves(ref)} <= {id(x) for x in jax.tree.leaves(trainer.actor.frozen)}
    trainer.fit()
    for r in read_metrics(out):
        assert np.isfinite(r["critic/vf_loss"]) and np.isfinite(r["actor/pg_loss"])
    after = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(trainer.actor.state())}
    assert not np.array_equal(before[("score",)], after[("score",)])
    assert any(not np.array_equal(before[k], after[k]) for k in trained - head)
    for k in set(before) - trained:
        np.testing.assert_array_equal(before[k], after[k], err_msg=str(k))
    trunk = os.path.join(out, "hf", "global_step_2")
    remade = export(os.path.join(out, "checkpoints"), str(tmp_path / "remade"))
    for directory in (trunk, remade):
        saved = load_file(os.path.join(directory, "value_head.safetensors"))
        np.testing.assert_array_equal(saved["v_head.summary.weight"], after[("score",)].T)


@pytest.mark.parametrize("overrides,message", [
    ({"algorithm.adv_estimator": "grpo", "critic.enable": False}, r"critic\.shared_trunk=True .*\(critic\.enable=False"),
    ({"critic.model.path": "/elsewhere"}, r"critic\.model\.path='/elsewhere'"),
    ({"trainer.critic_warmup": 2}, r"trainer\.critic_warmup=2 applies to a separate critic"),
    ({"critic.optim.lr": 1e-3}, r"critic\.optim\.lr=0\.001 applies to a separate critic"),
])
def test_settings_of_a_separate_critic_are_refused_by_name(tmp_path, overrides, message):
    settings = {"critic.shared_trunk": True, "critic.optim.lr": 1e-5, **overrides}
    with pytest.raises(ValueError, match=message):
        prepare(make_config(str(tmp_path), recipe="ppo", **settings))
