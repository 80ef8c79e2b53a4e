"""SFT (algorithm.type=sft): the loss equals transformers' masked cross-entropy, micro-batching leaves the gradient
unchanged, a CLI run on the arithmetic data learns, a stopped run resumes exactly, bad data is named."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from rlhf_jax import models
from rlhf_jax.parallel import make_mesh
from rlhf_jax.parallel.hosts import to_global
from rlhf_jax.train.engine import Role
from rlhf_jax.train.losses import SFT as SFT_LOSS
from rlhf_jax.runtime.preemption import StopRequest
from rlhf_jax.train.sft import SFTTrainer
from rlhf_jax.types import TrainBatch
from tests.train.helpers import cli_args, make_config, read_metrics, run_main

N, P, R, VOCAB = 16, 10, 12, 128


def sft_batch(seed: int) -> dict[str, np.ndarray]:
    """Left-padded prompts of 1..10 tokens, right-padded responses of 1..12 tokens with a loss mask that has holes
    (as the user turns of a conversation make), some rows empty of trained tokens."""
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((N, w), np.int32) for k, w in (("prompts", P), ("prompt_mask", P), ("responses", R),
                                                    ("response_mask", R), ("loss_mask", R))}
    for i in range(N):
        p, r = rng.integers(1, P + 1), rng.integers(1, R + 1)
        out["prompts"][i, P - p:] = rng.integers(1, VOCAB, p)
        out["prompt_mask"][i, P - p:] = 1
        out["responses"][i, :r] = rng.integers(1, VOCAB, r)
        out["response_mask"][i, :r] = 1
        out["loss_mask"][i, :r] = rng.random(r) < (0.0 if i == 3 else 0.7)
    return out


def _device(mesh, host) -> TrainBatch:
    """The SFT batch: the trained tokens (holes at user turns) are its response mask."""
    g = lambda x: to_global(mesh, x)  # noqa: E731
    return TrainBatch(input_ids=g(np.concatenate([host["prompts"], host["responses"]], 1)),
                      attention_mask=g(np.concatenate([host["prompt_mask"], host["response_mask"]], 1)),
                      responses=g(host["responses"]), response_mask=g(host["loss_mask"]))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.conftest import build_hf_checkpoint

    path = str(tmp_path_factory.mktemp("sft") / "llama")
    torch_model = build_hf_checkpoint("llama", path)
    return path, torch_model, make_mesh(2, 2, 2)


def _role(path, mesh):
    model = models.from_pretrained(path, mesh=mesh, dtype=jnp.float32, param_dtype=jnp.float32)
    return Role(model, mesh, optax.sgd(1.0), lambda step: 1.0)  # lr 1: before - after = the gradient


def test_loss_equals_transformers_masked_cross_entropy(setup):
    path, torch_model, mesh = setup
    host = sft_batch(1)
    ids = np.concatenate([host["prompts"], host["responses"]], 1).astype(np.int64)
    mask = np.concatenate([host["prompt_mask"], host["response_mask"]], 1).astype(np.int64)
    with torch.no_grad():
        logits = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.double()
    # position t predicts token t + 1: the response tokens are predicted from positions P - 1 .. P + R - 2
    nll = torch.nn.functional.cross_entropy(logits[:, P - 1:-1].reshape(-1, VOCAB),
                                            torch.tensor(host["responses"], dtype=torch.long).reshape(-1),
                                            reduction="none").reshape(N, R).numpy()
    weights = host["loss_mask"].astype(np.float64)
    expected = (nll * weights).sum() / weights.sum()

    metrics = _role(path, mesh).update(SFT_LOSS, _device(mesh, host), n_micro=1)
    assert abs(float(metrics["train/loss"]) - expected) < 1e-5
    assert float(metrics["train/loss_tokens"]) == weights.sum()


def test_micro_batches_do_not_change_the_gradient(setup):
    path, _, mesh = setup
    host = sft_batch(2)
    before = [np.asarray(x) for x in jax.tree.leaves(_role(path, mesh).params)]
    grads, losses = [], []
    for n_micro in (1, 2, 4):  # 4 shards x 4 rows: 4, 2 and 1 rows per shard and micro-batch
        role = _role(path, mesh)
        metrics = role.update(SFT_LOSS, _device(mesh, host), n_micro=n_micro)
        grads.append([b - np.asarray(a) for a, b in zip(jax.tree.leaves(role.params), before)])
        losses.append(float(metrics["train/loss"]))
    assert max(abs(g).max() for g in grads[0]) > 1e-3  # a real gradient
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    np.testing.assert_allclose(losses, losses[0], rtol=1e-6)


def test_packed_rows_equal_padded_rows(setup):
    """The default SFT layout packs several examples into each row: same loss, same gradient as padded rows."""
    from rlhf_jax.batch import pack_batch

    path, _, mesh = setup
    host = sft_batch(3)
    padded = _role(path, mesh)
    before = [np.asarray(x) for x in jax.tree.leaves(padded.params)]
    expected = padded.update(SFT_LOSS, _device(mesh, host), n_micro=1)
    for rows_per_micro in (1, 8):  # one row a micro-batch (several micro-batches), then all rows in one
        packed = pack_batch(host["prompts"], host["prompt_mask"], host["responses"], host["response_mask"], dp=4,
                            row_len=32, max_rows_per_micro=rows_per_micro)
        assert (packed.num_micro > 1) == (rows_per_micro == 1)
        role = _role(path, mesh)
        micros = [{k: to_global(mesh, v) for k, v in packed.micro(i).items()} for i in range(packed.num_micro)]
        grid = TrainBatch(response_mask=to_global(mesh, host["loss_mask"]))
        metrics = role.update_packed(SFT_LOSS, micros, grid, dp=4)
        np.testing.assert_allclose(float(metrics["train/loss"]), float(expected["train/loss"]), rtol=1e-5)
        for a, b, c in zip(jax.tree.leaves(role.params), jax.tree.leaves(padded.params), before):
            np.testing.assert_allclose(c - np.asarray(a), c - np.asarray(b), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------- trainer runs
SFT_FAST = {
    "algorithm.type": "sft", "data.train_batch_size": 8, "data.val_batch_size": 8,
    "data.train_files": ("builtin:arithmetic?max_value=4&train_size=64",), "data.max_response_length": 3,
    "custom_reward_function.path": None,
    "actor_rollout_ref.actor.optim.warmup_style": "cosine", "actor_rollout_ref.actor.optim.lr_warmup_steps": 1,
    "trainer.total_training_steps": 6, "trainer.save_freq": 3, "trainer.test_freq": 3,
}


class StopAfter(StopRequest):
    """Agrees to stop once the trainer has finished ``steps`` steps (what a SIGTERM after that step does)."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps, self.trainer = steps, None

    def agreed(self) -> bool:
        return self.trainer is not None and self.trainer.loop.step >= self.steps


def _params(trainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(trainer.actor.params)]


def test_stopped_run_resumes_exactly(tmp_path):
    full = SFTTrainer(make_config(str(tmp_path / "full"), recipe="sft", **SFT_FAST))
    full.fit()
    stop = StopAfter(2)
    split_dir = str(tmp_path / "split")
    first = SFTTrainer(make_config(split_dir, recipe="sft", **SFT_FAST), stop=stop)
    stop.trainer = first
    first.fit()
    assert first.loop.step == 2 and [r["step"] for r in read_metrics(split_dir)] == [1, 2]
    second = SFTTrainer(make_config(split_dir, recipe="sft", **SFT_FAST))
    second.fit()
    for a, b in zip(_params(full), _params(second)):
        np.testing.assert_array_equal(a, b)
    rows_full, rows_split = read_metrics(str(tmp_path / "full")), read_metrics(split_dir)
    assert [r["step"] for r in rows_split] == list(range(1, 7))
    for a, b in zip(rows_full, rows_split):
        for key in ("train/loss", "train/lr", "train/grad_norm", "val/loss", "training/epoch"):
            if key in a:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-6, err_msg=key)


def test_cli_run_learns_arithmetic(tmp_path):
    """configs/sft.py as shipped (4096 examples, 32 a step, 100 steps)."""
    out = str(tmp_path / "run")
    proc = run_main([f"--config={os.path.join(os.path.dirname(__file__), '..', '..', 'configs', 'sft.py')}",
                     f"--config.trainer.default_local_dir={out}",
                     "--config.trainer.logger=('jsonl',)", "--config.trainer.save_freq=100"], devices=1)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = read_metrics(out)
    val = [r for r in rows if "val/loss" in r]
    acc = "val-core/arithmetic/reward/mean@1"
    assert [r["step"] for r in val] == [0, 50, 100]
    assert val[-1]["val/loss"] < val[0]["val/loss"] / 3, val
    assert val[0][acc] < 0.05 and val[-1][acc] > 0.6, val
    train = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(train) == 100 and train[-1] < train[0] / 3
    assert os.path.exists(os.path.join(out, "hf", "global_step_100", "model.safetensors"))


def test_multiturn_row_without_messages_is_named(tmp_path):
    data = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data.write_text("\n".join(json.dumps(r) for r in (good, good, {"conversation": good["messages"]})) + "\n")
    proc = run_main(cli_args(str(tmp_path / "run"), recipe="sft", **{
        **{k: v for k, v in SFT_FAST.items() if k != "custom_reward_function.path"},
        "data.train_files": (str(data),), "data.val_files": (str(data),), "data.multiturn.enable": True,
        "data.prompt_template": "native"}))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{data} row 2: missing conversation column 'messages' (data.multiturn.messages_key)" in proc.stderr


def test_lora_sft_trains_only_the_adapters_and_exports(tmp_path):
    cfg = make_config(str(tmp_path / "lora"), recipe="sft", **{
        **SFT_FAST, "trainer.total_training_steps": 2, "trainer.test_freq": 0, "trainer.save_freq": 2,
        "trainer.save_hf_checkpoint": "last", "actor_rollout_ref.model.lora_rank": 4,
        "actor_rollout_ref.model.lora_alpha": 8.0, "actor_rollout_ref.model.use_remove_padding": False})  # padded rows
    trainer = SFTTrainer(cfg)
    base = [np.asarray(x) for x in jax.tree.leaves(trainer.actor.frozen)]
    adapters = _params(trainer)
    assert all(".lora_" in str(p) or "lora" in str(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        trainer.actor.params)[0])
    trainer.fit()
    for a, b in zip(base, jax.tree.leaves(trainer.actor.frozen)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert any(not np.array_equal(a, b) for a, b in zip(adapters, _params(trainer)))
    export = tmp_path / "lora" / "hf" / "global_step_2"
    assert (export / "model.safetensors").exists() and (export / "lora_adapter" / "adapter_config.json").exists()
