"""Mixture-of-Experts families (Qwen3-MoE, Qwen2-MoE) against transformers on tiny random checkpoints:
logits, greedy generation, export round trip, and the router's load-balancing loss against a float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rlhf_jax.models import from_pretrained, save_pretrained
from rlhf_jax.models.config import UnsupportedModelError, from_hf_dict
from rlhf_jax.models.moe import load_balancing_loss
from rlhf_jax.rollout import generate
from tests.conftest import left_padded_batch
from tests.rollout.rollout_testdata import hf_greedy, ragged_prompts

KINDS = ["qwen3_moe", "qwen2_moe"]
LENGTHS = [13, 9, 4, 13]


def _torch_forward(model, ids, mask, **kw):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), **kw)


def _ours(model, ids, mask):
    return np.asarray(jax.jit(lambda m, i, a: m(i, a))(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))


@pytest.mark.parametrize("kind", KINDS)
def test_moe_config_reads_sparse_layers_and_routing(hf_checkpoint, kind):
    path, ref = hf_checkpoint(kind)
    cfg = from_pretrained(path).config
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in ref.model.layers]
    assert list(cfg.sparse_layers) == sparse and any(sparse) and not all(sparse)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob == (kind == "qwen3_moe")
    assert cfg.shared_expert_intermediate_size == (48 if kind == "qwen2_moe" else 0)


@pytest.mark.parametrize("attn_impl", ["dense", "blockwise"])
@pytest.mark.parametrize("kind", KINDS)
def test_moe_logits_match_transformers(hf_checkpoint, kind, attn_impl):
    path, ref = hf_checkpoint(kind)
    ids, mask = left_padded_batch(np.random.default_rng(1), 128, LENGTHS)
    expected = _torch_forward(ref, ids, mask).logits.float().numpy()
    logits = _ours(from_pretrained(path, attn_impl=attn_impl), ids, mask)
    np.testing.assert_array_less(np.abs(logits - expected)[mask.astype(bool)].max(), 1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_moe_greedy_generation_matches_transformers(hf_checkpoint, kind):
    path, _ = hf_checkpoint(kind, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = ragged_prompts(seed=13, count=5)
    ours = generate(model, prompts, max_new_tokens=24, temperature=0.0, eos_token_ids=(), pad_token_id=0, max_num_seqs=2)
    assert all(len(t) == 24 for t in ours.tokens)
    assert ours.tokens == hf_greedy(hf, prompts, 24, [24 + 10_000], 0)


@pytest.mark.parametrize("kind", KINDS)
def test_moe_export_round_trip(hf_checkpoint, tmp_path, kind):
    path, ref = hf_checkpoint(kind)
    model = from_pretrained(path)
    out = save_pretrained(model, str(tmp_path / "export"), max_shard_bytes=200 * 1024)  # several files
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids, mask = left_padded_batch(np.random.default_rng(2), 128, [11, 6, 3])
    theirs = _torch_forward(reloaded.eval(), ids, mask).logits.float().numpy()
    np.testing.assert_array_less(np.abs(theirs - _ours(model, ids, mask))[mask.astype(bool)].max(), 1e-5)
    np.testing.assert_array_equal(theirs, _torch_forward(ref, ids, mask).logits.float().numpy())  # same weights
    assert from_pretrained(out).config.sparse_layers == model.config.sparse_layers


def numpy_load_balancing_loss(router_logits: list[np.ndarray], top_k: int, mask: np.ndarray) -> float:
    """transformers' ``load_balancing_loss_func`` in float64: over every sparse layer's real tokens, the fraction
    of top-k assignments of each expert times its mean router probability, summed, times the number of experts."""
    keep = mask.reshape(-1).astype(bool)
    probs = [np.exp(z - z.max(-1, keepdims=True)) for z in (np.asarray(z, np.float64)[keep] for z in router_logits)]
    probs = np.concatenate([p / p.sum(-1, keepdims=True) for p in probs])  # (layers * real tokens, X)
    X = probs.shape[-1]
    chosen = np.argsort(-probs, axis=-1)[:, :top_k]
    fraction = np.bincount(chosen.reshape(-1), minlength=X) / len(probs)
    return float(X * np.sum(fraction * probs.mean(0)))


@pytest.mark.parametrize("kind", KINDS)
def test_aux_loss_matches_transformers_definition(hf_checkpoint, kind):
    path, ref = hf_checkpoint(kind)
    ids, mask = left_padded_batch(np.random.default_rng(3), 128, [13, 5, 9, 2])
    out = _torch_forward(ref, ids, mask, output_router_logits=True)
    expected = numpy_load_balancing_loss([z.numpy() for z in out.router_logits], 2, mask)
    model = from_pretrained(path)
    hidden, stats = jax.jit(lambda m, i, a: m.hidden_states(i, a, with_router_stats=True))(
        model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32))
    sparse = sum(model.config.sparse_layers)
    assert float(stats.rows) == sparse * mask.sum()
    assert float(jnp.sum(stats.counts_X)) == 2 * sparse * mask.sum()  # top-2: two assignments per real token
    assert float(load_balancing_loss(stats)) == pytest.approx(expected, rel=1e-5)
    assert float(out.aux_loss) == pytest.approx(expected, rel=1e-5)  # the reference is transformers' own value


def test_dense_model_has_no_router_stats(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    ids, mask = left_padded_batch(np.random.default_rng(4), 128, [5, 3])
    _, stats = from_pretrained(path).hidden_states(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32),
                                                   with_router_stats=True)
    assert stats is None


def test_unsupported_model_type_names_the_moe_families():
    with pytest.raises(UnsupportedModelError, match="qwen2_moe, qwen3_moe") as err:
        from_hf_dict({"model_type": "mixtral", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                      "num_hidden_layers": 1, "num_attention_heads": 1})
    assert "'mixtral' is not supported" in str(err.value) and "llama" in str(err.value)


@pytest.mark.parametrize("kind", KINDS)
def test_expert_parallel_logits_equal_one_device(hf_checkpoint, kind):
    """8 fake devices, expert axis 4 (x data 2): each device holds 2 of the 8 experts; same logits as one device."""
    from jax.sharding import PartitionSpec as P

    from rlhf_jax.parallel import batch_sharding, make_mesh

    path, _ = hf_checkpoint(kind)
    ids, mask = left_padded_batch(np.random.default_rng(5), 128, [12, 7, 3, 12, 9, 1, 5, 12])
    expected = _ours(from_pretrained(path), ids, mask)
    mesh = make_mesh(data=2, fsdp=1, tensor=1, expert=4)
    model = from_pretrained(path, mesh=mesh)
    sparse = next(layer for layer in model.model.layers if layer.sparse)
    gate = sparse.mlp.experts.gate_proj[...]
    assert gate.sharding.spec == P("expert", None, None)
    assert {s.data.shape for s in gate.addressable_shards} == {(2, 64, 32)}
    ids_s = jax.device_put(jnp.asarray(ids, jnp.int32), batch_sharding(mesh, 2))
    mask_s = jax.device_put(jnp.asarray(mask, jnp.int32), batch_sharding(mesh, 2))
    assert ids_s.sharding.spec[0] == ("data", "expert")
    logits = np.asarray(jax.jit(lambda m, i, a: m(i, a))(model, ids_s, mask_s))
    np.testing.assert_allclose(logits[mask.astype(bool)], expected[mask.astype(bool)], atol=1e-5)


def test_remat_keeps_router_stats_and_gradients(hf_checkpoint):
    """A checkpointed (remat) sparse layer returns its router statistics too; gradients of logits + aux loss agree."""
    from flax import nnx

    path, _ = hf_checkpoint("qwen2_moe")
    ids, mask = left_padded_batch(np.random.default_rng(6), 128, [9, 4, 7])
    ids, mask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)

    def loss_and_grad(remat):
        graphdef, params = nnx.split(from_pretrained(path, remat=remat))

        def loss(p):
            hidden, stats = nnx.merge(graphdef, p).hidden_states(ids, mask, with_router_stats=True)
            return jnp.mean(hidden ** 2) + load_balancing_loss(stats)

        return jax.jit(jax.value_and_grad(loss))(params)

    (plain, plain_grads), (full, full_grads) = loss_and_grad("none"), loss_and_grad("full")
    assert float(full) == pytest.approx(float(plain), rel=1e-6)
    router = lambda g: np.asarray(g["model"]["layers"][1]["mlp"]["gate"][...])  # noqa: E731
    assert np.abs(router(plain_grads)).max() > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6), plain_grads, full_grads)
