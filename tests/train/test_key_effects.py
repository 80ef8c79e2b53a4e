"""Keys whose non-default value must change what a run does: checkpoint contents, removing older checkpoints,
profiling steps, the critic's own remat, the reward model as the only scorer (its batches split over the mesh),
the rollout's response length as the limit of the overlong penalty and the clip metric, the devices a run uses
(trainer.n_gpus_per_node) and the sampler's compute dtype (rollout.dtype)."""

from __future__ import annotations

import glob
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlhf_jax.runtime.checkpoint import Checkpointer
from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config, read_metrics, tiny_hf_checkpoint


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_checkpoint_contents_previous_removed_and_profiled_steps(tmp_path):
    out = str(tmp_path / "run")
    settings = dict(trainer__total_training_steps=3, trainer__save_freq=1, trainer__remove_previous_ckpt_in_save=True,
                    trainer__profile_steps=(2,),
                    actor_rollout_ref__actor__checkpoint__save_contents=("model",),
                    critic__checkpoint__save_contents=("model", "optimizer"))
    first = Trainer(make_config(out, "ppo", **settings))
    first.fit()
    ckpts = os.path.join(out, "checkpoints")
    # remove_previous_ckpt_in_save: steps 1 and 2 were saved and then removed
    assert sorted(d for d in os.listdir(ckpts) if d.isdigit()) == ["3"]
    items = set(os.listdir(os.path.join(ckpts, "3")))
    assert {"actor_params", "critic_params", "critic_opt", "extra"} <= items and "actor_opt" not in items
    reader = Checkpointer(ckpts, async_save=False)
    extra = reader.restore_extra(3)
    reader.close()
    assert extra["step"] == 3 and "data_state" not in extra and "kl_coef" not in extra  # no "extra" content
    # profile_steps=(2,): one trace, of step 2, in the run directory
    traces = glob.glob(os.path.join(out, "profile", "step_2", "plugins", "profile", "*", "*.xplane.pb"))
    assert traces and os.path.getsize(traces[0]) > 0
    assert sorted(os.listdir(os.path.join(out, "profile"))) == ["step_2"]

    # A resume restores what was saved and asked for; the actor's optimizer and the data position start fresh.
    second = Trainer(make_config(out, "ppo", **{**settings, "trainer__total_training_steps": 4}))
    fresh_opt, fresh_data = _host(second.actor.opt_state), second.loader.get_state()
    second.loop.resume(second)
    try:
        assert second.loop.step == 3
        assert _same(_host(second.actor.params), _host(first.actor.params))
        assert _same(_host(second.critic.opt_state), _host(first.critic.opt_state))
        assert _same(_host(second.actor.opt_state), fresh_opt)
        assert not _same(_host(first.actor.opt_state), fresh_opt)  # the comparison above can tell them apart
        assert second.loader.get_state() == fresh_data
    finally:
        second.close()


def test_load_contents_without_model_keeps_the_initial_weights(tmp_path):
    out = str(tmp_path / "run")
    first = Trainer(make_config(out, trainer__total_training_steps=1))
    first.fit()
    second = Trainer(make_config(out, trainer__total_training_steps=2,
                                 actor_rollout_ref__actor__checkpoint__load_contents=("optimizer", "extra")))
    initial = _host(second.actor.params)
    second.loop.resume(second)
    try:
        assert second.loop.step == 1
        assert _same(_host(second.actor.params), initial) and not _same(initial, _host(first.actor.params))
        assert _same(_host(second.actor.opt_state), _host(first.actor.opt_state))
        assert second.loader.get_state() == first.loader.get_state()  # "extra": the data position
    finally:
        second.close()


def _has_remat(model) -> bool:
    """Whether the gradient program of ``model`` (as the trainer built it) rematerializes its layers."""
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    ids, mask = jnp.ones((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32)
    loss = lambda s: jnp.sum(nnx.merge(graphdef, s)(ids, mask).astype(jnp.float32))  # noqa: E731
    return "remat" in str(jax.make_jaxpr(jax.grad(loss))(state))


def test_critic_remat_is_its_own_setting(tmp_path):
    cfg = make_config(str(tmp_path / "run"), "ppo", critic__model__enable_gradient_checkpointing=True,
                      critic__model__remat_policy="dots_saveable")
    trainer = Trainer(cfg)
    try:
        assert trainer.critic.config.remat == "dots_saveable" and trainer.actor.config.remat == "none"
        assert _has_remat(trainer.critic.model()) and not _has_remat(trainer.actor.model())
    finally:
        trainer.close()


def test_reward_model_alone_decides_the_score_with_batches_over_the_mesh(tmp_path):
    from rlhf_jax.rewards import RewardModelScorer

    rm_dir = tiny_hf_checkpoint("LlamaConfig", "LlamaForSequenceClassification", str(tmp_path / "rm"), num_labels=1)
    dump = str(tmp_path / "dump")
    cfg = make_config(str(tmp_path / "run"), reward_model__enable=True, reward_model__model__path=rm_dir,
                      reward_model__micro_batch_size_per_gpu=1, custom_reward_function__path=None,
                      trainer__total_training_steps=1, trainer__rollout_data_dir=dump)
    trainer = Trainer(cfg)
    rm = trainer.rollouts.reward_model
    # micro_batch_size_per_gpu rows on each of the 4 data-parallel shards (mesh 2 x 2 x 2, tensor 2)
    assert rm.micro_batch_size == 4 and rm.row_sharding.spec[0] == ("data", "fsdp")
    trainer.fit()
    rows = [json.loads(line) for line in open(os.path.join(dump, "1.jsonl"))]
    assert len(rows) == 8
    # the same RM on one device, unsharded, scores the dumped (prompt, response) pairs alone
    reference = RewardModelScorer.from_pretrained(rm_dir, micro_batch_size=3,
                                                  max_length=trainer.cfg.reward_model.max_length)
    want = reference.score_texts([r["input"] for r in rows], [r["output"] for r in rows])
    np.testing.assert_allclose([r["score"] for r in rows], want, rtol=0, atol=1e-5)
    assert np.ptp(want) > 0  # the scores vary: a rule-based score added to them would show
    step = read_metrics(str(tmp_path / "run"))[-1]
    assert step["critic/score/mean"] == pytest.approx(float(np.mean(want)), abs=1e-5)


def test_reward_model_refuses_rule_based_settings_it_would_ignore(tmp_path):
    from rlhf_jax.config import finalize

    cfg = make_config(str(tmp_path / "run"), reward_model__enable=True, reward_model__model__path="builtin:tiny")
    with pytest.raises(ValueError, match=r"custom_reward_function\.path would not be called"):
        finalize(cfg, num_devices=8, check_paths=False)
    cfg.custom_reward_function.path = None
    cfg.reward_model.model.input_tokenizer = "/other/tokenizer"
    with pytest.raises(ValueError, match=r"reward_model\.model\.input_tokenizer='/other/tokenizer'"):
        finalize(cfg, num_devices=8, check_paths=False)


def test_overlong_penalty_and_clip_metric_use_the_rollout_length(tmp_path):
    # data.max_response_length stays 4; the rollout generates 6 tokens and that is the limit both use
    cfg = make_config(str(tmp_path / "run"), actor_rollout_ref__rollout__response_length=6,
                      reward_model__overlong_buffer__enable=True, reward_model__overlong_buffer__len=2,
                      trainer__total_training_steps=1)
    trainer = Trainer(cfg)
    try:
        assert trainer.rollouts.reward_manager.overlong[2] == 6
        assert trainer.c.sampling.max_new_tokens == 6
    finally:
        trainer.close()


def test_chat_template_replaces_the_tokenizers(tmp_path):
    from rlhf_jax.train.setup import prepare

    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    for given in (template, str(path)):
        c = prepare(make_config(str(tmp_path / "run"), data__chat_template=given, data__prompt_template="native",
                                data__max_prompt_length=48))
        text = c.train_dataset.prompt_texts[0]
        assert text.startswith("<<") and text.endswith(">>=>"), text
        assert c.tokenizer.chat_template == template
    with pytest.raises(ValueError, match=r"data\.chat_template='no-such\.jinja'"):
        prepare(make_config(str(tmp_path / "run"), data__chat_template="no-such.jinja"))


def _rollout_probs_diff(trainer) -> float:
    trainer.fit()
    return read_metrics(trainer.loop.out_dir)[-1]["training/rollout_probs_diff_mean"]


def test_gpus_per_node_is_the_devices_the_run_uses(tmp_path):
    # 4 of the test process's 8 devices: mesh 2 x 2 (data x fsdp); the batch checks count 4 devices
    cfg = make_config(str(tmp_path / "run"), trainer__nnodes=1, trainer__n_gpus_per_node=4, mesh__data=2, mesh__fsdp=2,
                      mesh__tensor=1, trainer__total_training_steps=1)
    trainer = Trainer(cfg)
    first = set(jax.devices()[:4])
    assert trainer.c.mesh.devices.size == 4 and set(trainer.c.mesh.devices.flat) == first
    assert trainer.cfg.derived.num_devices == 4 and trainer.cfg.derived.dp_size == 4
    assert all(leaf.sharding.device_set == first for leaf in jax.tree.leaves(trainer.actor.params))
    # float32 sampling gives the float32 training passes' log-probs (compare the rollout dtype test below)
    assert _rollout_probs_diff(trainer) < 1e-6
    assert all("bf16[" not in program.as_text() for program in trainer.rollouts.sampler._compiled.values())


def test_rollout_dtype_is_the_samplers_compute_dtype(tmp_path):
    cfg = make_config(str(tmp_path / "run"), actor_rollout_ref__rollout__dtype="bfloat16",
                      trainer__total_training_steps=1)
    trainer = Trainer(cfg)
    # the actor (its training passes) keeps float32 compute; the sampler computes in bfloat16 over the same arrays
    assert trainer.actor.config.dtype == jnp.float32 and trainer.cfg.actor_rollout_ref.model.compute_dtype == "float32"
    assert nnx.merge(trainer.rollouts.sampler.graphdef, trainer.actor.state()).config.dtype == jnp.bfloat16
    diff = _rollout_probs_diff(trainer)
    # the compiled decode program holds bfloat16 activations (its KV cache among them; XLA:CPU widens the dots)
    (program,) = trainer.rollouts.sampler._compiled.values()
    assert re.search(r"dynamic-update-slice\S* = bf16\[", program.as_text())
    # the sampled log-probs are bfloat16 ones: they differ from the float32 recomputation by far more than
    # float32 rounding
    # (|p_train - p_rollout| per token; the tiny model's tokens have p ~ 1/257, so ~1e-6 is ~1e-3 relative)
    assert 1e-7 < diff < 1e-4, diff  # float32 sampling: < 1e-6 (the test above)
