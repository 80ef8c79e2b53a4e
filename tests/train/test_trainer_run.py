"""End-to-end runs of the trainer: the CLI on the default recipe, other algorithms, KL controller, export."""

import glob
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import cli_args, make_config, read_metrics, run_main, run_tool

DOCUMENTED = [
    "critic/score/mean", "critic/score/max", "critic/score/min", "critic/rewards/mean", "critic/advantages/mean",
    "critic/returns/mean", "actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
    "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr", "actor/kl_coef", "response_length/mean",
    "response_length/max", "response_length/min", "response_length/clip_ratio", "prompt_length/mean",
    "prompt_length/clip_ratio", "timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/ref",
    "timing_s/adv", "timing_s/update_actor", "timing_per_token_ms/gen", "perf/total_num_tokens",
    "perf/time_per_step", "perf/throughput", "perf/max_memory_allocated_gb", "training/global_step", "training/epoch",
]


def _finite(metrics: dict) -> bool:
    return all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


def test_default_recipe_cli_writes_metrics_tensorboard_and_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    args = cli_args(out, **{"trainer.logger": ("console", "tensorboard", "jsonl"), "trainer.test_freq": 2,
                            "trainer.val_before_train": True, "trainer.save_hf_checkpoint": "last",
                            "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "mesh.context": 0})
    proc = run_main(args, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2" in proc.stdout  # the console line
    # mesh.context=0 (automatic): the tiny model's update surely fits one device, so nothing is planned
    assert "planning mesh.context" not in proc.stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for name in DOCUMENTED:
        assert name in rows[1], name
    assert any(k.startswith("val-core/arithmetic/reward/mean@") for k in rows[0])
    assert any(k.startswith("val-core/arithmetic/reward/mean@") for k in rows[2])
    assert _finite(rows[2])
    assert glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))
    assert os.path.isdir(os.path.join(out, "checkpoints", "2"))
    assert os.path.exists(os.path.join(out, "hf", "global_step_2", "model.safetensors"))
    # The plot command on the run's directory, as a user would type it after the run.
    plot = run_tool("rlhf_jax.plot", out, timeout=300)
    assert plot.returncode == 0, plot.stderr
    assert plot.stdout.strip() == os.path.join(out, "curve.png") and os.path.getsize(plot.stdout.strip()) > 10_000


@pytest.mark.parametrize("recipe", ["ppo", "rloo", "reinforce_pp"])
def test_other_algorithms_run_with_finite_metrics(tmp_path, recipe):
    cfg = make_config(str(tmp_path), recipe)
    last = Trainer(cfg).fit()
    assert _finite(last)
    assert last["training/global_step"] == 2
    if recipe == "ppo":
        for name in ("critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/vf_explained_var", "critic/grad_norm"):
            assert name in last, name


def test_adaptive_kl_controller_moves_the_coefficient(tmp_path):
    cfg = make_config(str(tmp_path), "grpo", **{
        "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.1,
        "algorithm.kl_ctrl.target_kl": 1e-6, "algorithm.kl_ctrl.horizon": 10, "trainer.total_training_steps": 3,
        "actor_rollout_ref.actor.optim.lr": 1e-2,
    })
    Trainer(cfg).fit()
    rows = read_metrics(str(tmp_path))
    coeffs = [r["actor/reward_kl_penalty_coeff"] for r in rows]
    assert coeffs[0] == pytest.approx(0.1)
    # Step 1 samples from the initial policy, which equals the reference: KL 0 is below target, the
    # error clips at -0.2 and beta shrinks by 1 - 0.2 * 8 sequences / horizon 10.
    assert coeffs[1] == pytest.approx(0.1 * 0.84, rel=1e-5)
    # After an update the KL is far above the tiny target: beta grows by 1 + 0.2 * 8 / 10.
    assert rows[1]["actor/reward_kl_penalty"] > 1e-6
    assert coeffs[2] == pytest.approx(0.1 * 0.84 * 1.16, rel=1e-5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-step GRPO run shared by the export tests: a checkpoint after each step and an HF export of the last."""
    out = str(tmp_path_factory.mktemp("trained"))
    trainer = Trainer(make_config(out, "grpo", **{"trainer.save_freq": 1, "trainer.total_training_steps": 2,
                                                  "trainer.save_hf_checkpoint": "last"}))
    trainer.fit()
    return trainer, out


def test_exported_hf_directory_matches_trained_model(trained):
    trainer, out = trained
    export = os.path.join(out, "hf", "global_step_2")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    tok = transformers.AutoTokenizer.from_pretrained(export)
    ids = np.asarray([tok("3+4=12+1=")["input_ids"]], np.int64)
    with torch.no_grad():
        expected = hf_model(input_ids=torch.tensor(ids)).logits.numpy()
    ours = np.asarray(trainer.actor.model()(jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(ours, expected, atol=1e-4)
    # Training changed the weights: the export is not the initial model.
    initial = transformers.AutoModelForCausalLM.from_pretrained(trainer.c.model_path).eval()
    with torch.no_grad():
        assert np.abs(initial(input_ids=torch.tensor(ids)).logits.numpy() - expected).max() > 1e-4


def test_export_cli_for_any_saved_step(tmp_path, trained):
    trainer, run_dir = trained
    ckpt_root = os.path.join(run_dir, "checkpoints")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for step_arg, out_name in ((["--step", "1"], "step1"), ([], "latest")):
        out = str(tmp_path / out_name)
        proc = run_tool("rlhf_jax.export", "--checkpoint", ckpt_root, "--out", out, *step_arg, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "latest"))
    ids = np.asarray([tok("1+1=2+2=")["input_ids"]], np.int64)
    latest = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "latest")).eval()
    step1 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "step1")).eval()
    with torch.no_grad():
        latest_logits = latest(input_ids=torch.tensor(ids)).logits.numpy()
        step1_logits = step1(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(trainer.actor.model()(jnp.asarray(ids, jnp.int32))), latest_logits, atol=1e-4)
    assert np.abs(latest_logits - step1_logits).max() > 1e-5  # step 1 is a different model
    bad = run_tool("rlhf_jax.export", "--checkpoint", ckpt_root, "--out", str(tmp_path / "x"), "--step", "7", env=env,
                   timeout=300)
    assert bad.returncode == 2 and "no step 7" in bad.stderr


def test_val_only_validates_once_and_trains_nothing(tmp_path):
    cfg = make_config(str(tmp_path), "grpo", **{"trainer.val_only": True, "trainer.test_freq": 0,
                                                 "trainer.val_before_train": False})
    trainer = Trainer(cfg)
    before = jax.tree.map(np.asarray, trainer.actor.params)
    val = trainer.fit()
    assert any(k.startswith("val-core/arithmetic/reward/mean@") for k in val)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0]
    ckpt = os.path.join(str(tmp_path), "checkpoints")
    assert not os.path.isdir(ckpt) or not os.listdir(ckpt)
    after = jax.tree.map(np.asarray, trainer.actor.params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
