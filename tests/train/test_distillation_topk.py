"""forward_kl_topk through the training passes: the teacher's pass returns its top-k tokens and log-probs (N, R, k),
equal to np.argsort of a float64 log-softmax of transformers' logits, in the padded and the packed layout; the
student's update reads its own log-probs at those tokens, with the same loss and gradients in both layouts and the
loss of verl's formula over float64 log-softmaxes; and a 2-step run trains on it, its first step's metric equal to
that formula over the samples it drew."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch

from rlhf_jax.algos import DistillSpec
from rlhf_jax.parallel import make_mesh
from rlhf_jax.parallel.hosts import gather_all, to_global
from rlhf_jax.train import losses
from rlhf_jax.types import TrainBatch
from tests.train.helpers import loss_specs, make_config, read_metrics
from tests.train.test_packing import DP, N, P, R, _micros, _padded, _role, assert_grads_close, ragged_batch

K = 6


def log_softmax64(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def dense_response_log_softmax(torch_model, host, temperature=1.0):
    """float64 log-softmax (N, R, V) of transformers' logits at the states that predict each response token."""
    ids = np.concatenate([host["prompts"], host["responses"]], 1)
    mask = np.concatenate([host["prompt_mask"], host["response_mask"]], 1)
    positions = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    with torch.no_grad():
        logits = torch_model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                             position_ids=torch.tensor(positions)).logits.double().numpy()
    return log_softmax64(logits[:, P - 1:P + R - 1] / temperature)


def topk_ref(student, teacher, clamp):
    """verl's compute_forward_kl_topk per token from (N, R, k) float64 log-probs."""
    s, t = (student, teacher) if clamp is None else (np.maximum(student, clamp), np.maximum(teacher, clamp))
    return np.maximum((np.exp(t) * (t - s)).sum(-1), 0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.conftest import build_hf_checkpoint

    student = str(tmp_path_factory.mktemp("student") / "llama")
    teacher = str(tmp_path_factory.mktemp("teacher") / "llama")
    torch_student = build_hf_checkpoint("llama", student, seed=0)
    torch_teacher = build_hf_checkpoint("llama", teacher, seed=1)
    mesh = make_mesh(2, 2, 2)
    return mesh, ragged_batch(0, vocab=128), (student, torch_student), (teacher, torch_teacher)


def test_teacher_top_k_in_both_layouts_is_argsort_of_the_dense_log_softmax(models):
    mesh, host, _, (teacher, torch_teacher) = models
    role = _role(teacher, mesh)
    padded = role.log_probs(_padded(mesh, host), n_micro=2, temperature=0.7, topk=K)  # temperature: unused
    packed = role.log_probs_packed(_micros(mesh, host), (N, R), dp=DP, temperature=0.7, topk=K)
    dense = dense_response_log_softmax(torch_teacher, host)  # temperature 1: verl's teacher
    want_ids = np.argsort(-dense, axis=-1)[..., :K]
    want_logp = np.take_along_axis(dense, want_ids, -1)
    mask = host["response_mask"].astype(bool)
    for name, (logp, ids) in {"padded": padded, "packed": packed}.items():
        logp, ids = np.asarray(logp), np.asarray(ids)
        assert logp.shape == ids.shape == (N, R, K) and ids.dtype == np.int32, name
        np.testing.assert_array_equal(ids[mask], want_ids[mask], err_msg=name)
        np.testing.assert_allclose(logp[mask], want_logp[mask], rtol=0, atol=2e-5, err_msg=name)
    assert np.all(np.asarray(packed[0])[~mask] == 0) and np.all(np.asarray(packed[1])[~mask] == 0)


def _distill_step(student, spec, mesh, host, topk, packed: bool):
    """One SGD (lr 1) step of the distillation loss alone: (metrics, gradient)."""
    role = _role(student, mesh)
    g = lambda x: to_global(mesh, x)  # noqa: E731
    before = jax.tree.map(np.asarray, role.params)
    logp = role.log_probs(_padded(mesh, host), n_micro=1, temperature=spec.temperature)
    grid = TrainBatch(response_mask=g(host["response_mask"]), advantages=g(host["advantages"]), old_log_probs=logp,
                      teacher_topk_log_probs=topk[0], teacher_topk_ids=topk[1])
    loss = losses.actor(spec)
    if packed:
        metrics = role.update_packed(loss, _micros(mesh, host), grid, dp=DP, rng=jax.random.key(0))
    else:
        p = _padded(mesh, host)
        mb = grid.replace(input_ids=p.input_ids, attention_mask=p.attention_mask, responses=p.responses)
        metrics = role.update(loss, mb, n_micro=2, rng=jax.random.key(0))
    grads = jax.tree.map(lambda b, a: b - np.asarray(a), before, role.params)
    return {k: float(v) for k, v in metrics.items()}, grads, role.params


def test_student_loss_reads_its_log_probs_at_the_teachers_top_k_in_both_layouts(models):
    mesh, host, (student, torch_student), (teacher, torch_teacher) = models
    agg, temperature = "seq-mean-token-mean", 0.7  # (token-mean: the run below)
    topk = _role(teacher, mesh).log_probs(_padded(mesh, host), n_micro=1, temperature=1.0, topk=K)
    ids, teacher_logp = np.asarray(topk[1]), np.asarray(topk[0]).astype(np.float64)
    student_logp = np.take_along_axis(dense_response_log_softmax(torch_student, host, temperature), ids, -1)
    m = host["response_mask"].astype(np.float64)
    # a clamp below which a third of the (near-uniform) tiny models' log-probs lie
    clamp = float(np.quantile(np.minimum(student_logp, teacher_logp)[m > 0], 0.3))
    spec = dataclasses.replace(loss_specs(loss_agg_mode=agg, temperature=temperature)[0], distill=DistillSpec(
        loss_mode="forward_kl_topk", use_task_rewards=False, log_prob_min_clamp=clamp))
    m_pad, g_pad, _ = _distill_step(student, spec, mesh, host, topk, packed=False)
    m_packed, g_packed, params = _distill_step(student, spec, mesh, host, topk, packed=True)

    d = topk_ref(student_logp, teacher_logp, clamp)
    want = np.mean((d * m).sum(-1) / m.sum(-1))  # every row has a response token here
    for name, metrics in {"padded": m_pad, "packed": m_packed}.items():
        assert metrics["distillation/loss"] == pytest.approx(want, rel=1e-5, abs=1e-6), name
        assert metrics["distillation/student_mass"] == pytest.approx(
            (np.exp(student_logp).sum(-1) * m).sum() / m.sum(), rel=1e-5), name
        assert metrics["distillation/teacher_mass"] == pytest.approx(
            (np.exp(teacher_logp).sum(-1) * m).sum() / m.sum(), rel=1e-5), name
    assert want > 0.005 and m_pad["actor/grad_norm"] > 0  # two different models: a divergence to train
    assert want != pytest.approx(np.mean((topk_ref(student_logp, teacher_logp, None) * m).sum(-1) / m.sum(-1)))
    assert_grads_close(g_pad, g_packed, params)


def test_a_two_step_run_trains_on_the_top_k_forward_kl_of_its_samples(tmp_path):
    """A teacher over the default tiny model's vocabulary (other weights) distils into it with the divergence as the
    only loss: both steps train on a finite loss, and step 1's equals the formula over the samples it drew."""
    from rlhf_jax.train.trainer import Trainer
    from tests.train.helpers import tiny_hf_checkpoint

    teacher = tiny_hf_checkpoint("LlamaConfig", "LlamaForCausalLM", str(tmp_path / "teacher"),
                                 intermediate_size=128, initializer_range=0.2)
    cfg = make_config(str(tmp_path / "run"), distillation__enabled=True,
                      distillation__teacher_models__teacher_model__model_path=teacher,
                      distillation__distillation_loss__loss_mode="forward_kl_topk",
                      distillation__distillation_loss__topk=K,
                      distillation__distillation_loss__log_prob_min_clamp=-8.0,
                      distillation__distillation_loss__use_task_rewards=False,
                      actor_rollout_ref__actor__use_kl_loss=False,  # the teacher takes the reference's place
                      actor_rollout_ref__actor__ppo_mini_batch_size=4)  # one mini-batch: step 1 reads the start
    trainer = Trainer(cfg)
    seen = []
    prepare = trainer.prepare

    def observe(scored, kl_coef, timer):  # the prepared batch and the student as it was before the update
        prepared = prepare(scored, kl_coef, timer)
        if not seen:
            seen.append((prepared, jax.tree.map(np.asarray, trainer.actor.state())))
        return prepared

    trainer.prepare = observe
    trainer.fit()
    rows = read_metrics(str(tmp_path / "run"))
    assert len(rows) == 2 and all(np.isfinite(r["distillation/loss"]) and r["actor/grad_norm"] > 0 for r in rows)

    (prepared, state), = seen
    b = prepared.batch
    ids, teacher_logp = gather_all(b.teacher_topk_ids), gather_all(b.teacher_topk_log_probs).astype(np.float64)
    assert b.ref_log_probs is None and ids.shape[-1] == K
    # the student's dense log-softmax at the sampled sequences, from the weights step 1 trained
    from flax import nnx

    model = nnx.merge(trainer.actor.graphdef, state)
    input_ids, attention = gather_all(b.input_ids), gather_all(b.attention_mask)
    width = ids.shape[1]
    hidden = model.hidden_states(input_ids, attention)[:, -width - 1:-1]
    dense = log_softmax64(np.asarray(model.logits_from_hidden(hidden), np.float64)
                          / trainer.actor_loss.spec.temperature)
    d = topk_ref(np.take_along_axis(dense, ids, -1), teacher_logp, -8.0)
    m = gather_all(b.response_mask).astype(np.float64)
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "token-mean"
    assert rows[0]["distillation/loss"] == pytest.approx((d * m).sum() / m.sum(), rel=1e-4)
