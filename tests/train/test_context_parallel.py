"""Context parallelism: packed passes with each sequence split over mesh.context equal the unsplit passes.

For each split c, the same packed batch (one shard, prompts shared by two samples) runs on one device and on a
(context=c) mesh of c devices: per-token log-probs, the actor loss and its
gradient (an SGD step with learning rate 1 makes ``before - after`` the gradient) agree to float32 rounding. The
models have 8 query heads, so that every split divides them; GQA models have 2 kv heads, fewer than the split
(they are repeated). That the split happens is checked on the compiled program (all-to-alls; activations sharded
on ``context``), since equal numbers alone would also come from an unsplit program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlhf_jax import models
from rlhf_jax.batch import pack_batch
from rlhf_jax.batch.packing import MAX_BRANCHES
from rlhf_jax.models.sequence_split import check_heads
from rlhf_jax.parallel import make_mesh
from rlhf_jax.parallel.hosts import to_global
from rlhf_jax.train import losses
from rlhf_jax.train.engine import Role
from rlhf_jax.types import TrainBatch
from tests.train.helpers import loss_specs
from tests.train.test_packing import assert_grads_close

N, P, R, ROW_LEN = 8, 12, 10, 32
MODELS = {"dense": ("llama", dict(num_attention_heads=8, num_key_value_heads=8)),
          "gqa": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2)),
          "window": ("mistral_window", dict(num_attention_heads=8, num_key_value_heads=2))}


def shared_prompt_batch(seed: int, vocab: int = 128) -> dict[str, np.ndarray]:
    """Rows 2j and 2j + 1 sample one left-padded prompt of 4..12 tokens; responses of 3..10 tokens."""
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((N, w), np.int32) for k, w in (("prompts", P), ("prompt_mask", P), ("responses", R),
                                                       ("response_mask", R))}
    for i in range(N):
        if i % 2 == 0:
            p = rng.integers(4, P + 1)
            prompt = rng.integers(1, vocab, p)
        r = rng.integers(3, R + 1)
        out["prompts"][i, P - p:], out["prompt_mask"][i, P - p:] = prompt, 1
        out["responses"][i, :r], out["response_mask"][i, :r] = rng.integers(1, vocab, r), 1
    out["advantages"] = rng.normal(size=(N, R)).astype(np.float32) * out["response_mask"]
    out["noise"] = rng.normal(scale=0.1, size=(N, R)).astype(np.float32) * out["response_mask"]
    return out


def _micros(mesh, host, dp: int) -> list[dict]:
    packed = pack_batch(host["prompts"], host["prompt_mask"], host["responses"], host["response_mask"],
                        dp=dp, row_len=ROW_LEN, max_rows_per_micro=1)
    assert ((packed.segment_ids & MAX_BRANCHES) >= 2).any()  # two responses share a prompt in a row
    return [{k: to_global(mesh, v) for k, v in packed.micro(i).items()} for i in range(packed.num_micro)]


def _passes(path: str, mesh, host, dp: int, attn: str, context_attention: str = "auto"):
    """(log-probs, actor metrics, gradients) of the packed batch on ``mesh``."""
    model = models.from_pretrained(path, mesh=mesh, attn_impl=attn, dtype=jnp.float32, param_dtype=jnp.float32,
                                   context_attention=context_attention)
    role = Role(model, mesh, optax.sgd(1.0), lambda step: 1.0)
    g = lambda x: to_global(mesh, x)  # noqa: E731
    logp = role.log_probs_packed(_micros(mesh, host, dp), (N, R), dp=dp, temperature=0.7)
    mask = g(host["response_mask"])
    spec = loss_specs(use_kl_loss=True, kl_loss_coef=0.04, entropy_coeff=0.01, temperature=0.7,
                      clip_ratio_low=0.05, clip_ratio_high=0.05)[0]
    grid = TrainBatch(response_mask=mask, advantages=g(host["advantages"]),
                      old_log_probs=logp + g(host["noise"]), ref_log_probs=logp - g(host["noise"]))
    before = jax.tree.map(np.asarray, role.params)
    metrics = role.update_packed(losses.actor(spec), _micros(mesh, host, dp), grid, dp=dp, rng=jax.random.key(1))
    grads = jax.tree.map(lambda b, a: b - np.asarray(a), before, role.params)
    return np.asarray(logp), {k: float(v) for k, v in metrics.items()}, grads, role


_REFERENCE: dict = {}


def _reference(path: str, kind: str, host, attn: str):
    if (kind, attn) not in _REFERENCE:
        _REFERENCE[kind, attn] = _passes(path, make_mesh(data=1, fsdp=1, devices=jax.devices()[:1]), host, 1, attn)[:3]
    return _REFERENCE[kind, attn]


# Each split and each model once (a Latin square: every split meets a model whose key/value heads it must repeat or
# not, dense attention and the blockwise kernel), not all nine pairs: each case compiles an 8-device update.
@pytest.mark.parametrize("kind,context,attn", [("dense", 2, "auto"), ("gqa", 4, "blockwise"), ("window", 8, "auto")])
def test_split_passes_equal_unsplit(hf_checkpoint, kind, context, attn):
    arch, dims = MODELS[kind]
    path, _ = hf_checkpoint(arch, **dims)
    host = shared_prompt_batch(0)
    ref_logp, ref_metrics, ref_grads = _reference(path, kind, host, attn)
    mesh = make_mesh(data=1, fsdp=1, context=context, devices=jax.devices()[:context])
    assert_passes_equal((ref_logp, ref_metrics, ref_grads), _passes(path, mesh, host, 1, attn), host)


def assert_passes_equal(want: tuple, got: tuple, host) -> None:
    """``_passes``' (log-probs, metrics, gradients) of a split mesh against the unsplit ones (float32 rounding)."""
    (ref_logp, ref_metrics, ref_grads), (logp, metrics, grads, role) = want, got
    mask = host["response_mask"].astype(bool)
    np.testing.assert_allclose(logp[mask], ref_logp[mask], rtol=1e-5, atol=1e-6)
    assert ref_metrics["actor/pg_clipfrac"] > 0  # the clipped branch is exercised
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-7), k
    assert_grads_close(ref_grads, grads, role.params)


def test_the_compiled_pass_splits_the_sequence(hf_checkpoint):
    """The log-prob program of a context-4 mesh moves activations between the length and the head split
    (all-to-all) and its layer activations are sharded on ``context``; the unsplit program has neither."""
    path, _ = hf_checkpoint("qwen2", **MODELS["gqa"][1])
    host = shared_prompt_batch(0)
    texts = {}
    for context in (1, 4):
        mesh = make_mesh(data=2, fsdp=1, context=context, devices=jax.devices()[:2 * context])
        model = models.from_pretrained(path, mesh=mesh, attn_impl="blockwise", dtype=jnp.float32)
        role = Role(model, mesh)
        micro = _micros(mesh, host, 2)[0]
        program = role.packed_forward_program("logp", micro["input_ids"].shape, micro["logit_positions"].shape[0],
                                              (N, R), 2, temperature=1.0)
        texts[context] = program.as_text()
    assert "all-to-all" in texts[4] and "all-to-all" not in texts[1]


def test_heads_that_the_split_cannot_divide_are_refused_by_name():
    check_heads(8, context=4, tensor=2)
    check_heads(9, context=1, tensor=1)
    with pytest.raises(ValueError, match=r"mesh.context=2 x mesh.tensor=1 does not divide the model's 9 attention"):
        check_heads(9, context=2, tensor=1)
    with pytest.raises(ValueError, match="mesh.context=4"):
        check_heads(8, context=4, tensor=4)


def _grpo_run(out: str, **mesh) -> tuple[list[dict], dict, list[str]]:
    from rlhf_jax.train.trainer import Trainer
    from tests.train.helpers import make_config, read_metrics

    # SGD: a parameter moves by lr x its gradient, so parameters compare gradients (Adam's m / sqrt(v) would turn an
    # element's rounding-noise gradient into a whole step either way)
    trainer = Trainer(make_config(out, **{"mesh.fsdp": 1, "mesh.tensor": 1, "actor_rollout_ref.actor.optim.optimizer":
                                          "sgd", "actor_rollout_ref.actor.optim.lr": 0.1, **mesh}))
    try:
        trainer.fit()
        params = jax.tree.map(np.asarray, trainer.actor.params)
        programs = [p.as_text() for p in trainer.actor._compiled.values() if hasattr(p, "as_text")]
        return read_metrics(out), params, programs
    finally:
        trainer.close()


def test_grpo_run_with_context_4_matches_context_1(tmp_path):
    """Two GRPO steps (SGD) of the tiny model (4 heads, 2 kv heads) on (data=2, context=4) and on 2 devices
    (data=2): the sampler splits its cache over the context axis and samples the same responses; the metrics of both
    steps and the trained parameters agree to 1e-5."""
    split_metrics, split_params, programs = _grpo_run(str(tmp_path / "split"), **{"mesh.data": 2, "mesh.context": 4})
    assert any("all-to-all" in p for p in programs)  # the actor's passes ran split
    ref_metrics, ref_params, _ = _grpo_run(str(tmp_path / "ref"), **{"mesh.data": 2,
                                                                    "trainer.n_gpus_per_node": 2})
    assert len(split_metrics) == len(ref_metrics) == 2
    for got, want in zip(split_metrics, ref_metrics):
        keys = [k for k in want if k.startswith(("actor/", "response_length/", "critic/score", "critic/rewards"))
                and "lr" not in k]
        assert "actor/pg_loss" in keys and "actor/grad_norm" in keys
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
    for a, b in zip(jax.tree.leaves(split_params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_padded_sft_step_with_context_2_equals_one_device(hf_checkpoint):
    """The SFT update on left-padded rows of P + R = 22 tokens (no packing: the padding mask, positions from it)
    split over context 2 gives the unsplit loss and gradient."""
    path, _ = hf_checkpoint("qwen2", **MODELS["gqa"][1])
    host = shared_prompt_batch(1)
    results = []
    for context in (1, 2):
        mesh = make_mesh(data=1, fsdp=1, context=context, devices=jax.devices()[:context])
        model = models.from_pretrained(path, mesh=mesh, dtype=jnp.float32, param_dtype=jnp.float32)
        role = Role(model, mesh, optax.sgd(1.0), lambda step: 1.0)
        g = lambda x: to_global(mesh, x)  # noqa: E731
        mb = TrainBatch(input_ids=g(np.concatenate([host["prompts"], host["responses"]], 1)),
                        attention_mask=g(np.concatenate([host["prompt_mask"], host["response_mask"]], 1)),
                        responses=g(host["responses"]), response_mask=g(host["response_mask"]))
        before = jax.tree.map(np.asarray, role.params)
        metrics = role.update(losses.SFT, mb, n_micro=2)
        grads = jax.tree.map(lambda b, a: b - np.asarray(a), before, role.params)
        results.append(({k: float(v) for k, v in metrics.items()}, grads, role))
    (m1, g1, _), (m2, g2, role) = results
    assert m2["train/loss"] == pytest.approx(m1["train/loss"], rel=1e-5)
    assert_grads_close(g1, g2, role.params)


def test_a_run_whose_heads_the_split_cannot_divide_stops_before_loading(tmp_path):
    """Loading a role checks the checkpoint's heads against mesh.context x mesh.tensor (SmolLM2's 9 heads) where
    mesh.context_attention=ulysses; auto runs that split with the key/value gather."""
    import json

    from rlhf_jax.train.setup import _check_mesh_axes
    from tests.train.helpers import make_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 9}))
    cfg = make_config(str(tmp_path / "run"), **{"mesh.context": 3, "mesh.tensor": 1,
                                                "mesh.context_attention": "ulysses"})
    _check_mesh_axes(cfg, str(tmp_path))
    cfg.mesh.context = 2
    cfg.mesh.context_attention = "auto"  # gathers keys/values instead
    _check_mesh_axes(cfg, str(tmp_path))
    cfg.mesh.context_attention = "ulysses"
    with pytest.raises(ValueError, match=r"mesh.context=2 x mesh.tensor=1 does not divide the model's 9 attention"):
        _check_mesh_axes(cfg, str(tmp_path))

