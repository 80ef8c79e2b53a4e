"""``einsum_f32``: bfloat16 operands, float32 products on every backend, and the bfloat16 sampler it lets run on
XLA:CPU (whose dot thunk has no BF16 x BF16 = F32 kernel for the prefill's attention scores)."""

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.models.hub import resolve_model_path
from rlhf_jax.models import from_pretrained
from rlhf_jax.models.dots import einsum_f32
from rlhf_jax.rollout import generate


def test_bf16_operands_give_float32_products():
    rng = np.random.default_rng()
    a = jnp.asarray(rng.normal(size=(2, 3, 5, 8)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=(2, 7, 5, 8)), jnp.bfloat16)
    out = jax.jit(lambda a, b: einsum_f32("btkd,bskd->bkts", a, b))(a, b)
    assert out.dtype == jnp.float32
    want = np.einsum("btkd,bskd->bkts", np.asarray(a, np.float64), np.asarray(b, np.float64))  # the bf16 values'
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def _teacher_forced(model, out, temperature: float) -> np.ndarray:
    b = jax.device_get(out.batch)
    P, R = b.prompts.shape[1], b.responses.shape[1]
    logits = np.asarray(model(out.batch.input_ids(), out.batch.attention_mask()), np.float64)[:, P - 1:P + R - 1]
    logits = logits / temperature
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return np.take_along_axis(logp, b.responses[:, :, None], axis=2)[:, :, 0]


def test_a_bfloat16_model_samples_with_its_own_log_probs():
    path = resolve_model_path("builtin:tiny", None)
    bf16 = from_pretrained(path, dtype=jnp.bfloat16, param_dtype=jnp.float32, attn_impl="dense")
    f32 = from_pretrained(path, attn_impl="dense")
    rng = np.random.default_rng()
    # P >= 32 and several rows: the shapes where XLA:CPU ran the attention-score dot on its own
    prompts = [list(rng.integers(3, 200, size=int(n))) for n in rng.integers(20, 40, size=4)]
    out = generate(bf16, prompts, max_new_tokens=6, temperature=1.0, n=2, seed=int(rng.integers(1 << 30)),
                   pad_token_id=0)
    live = np.asarray(jax.device_get(out.batch.response_mask)).astype(bool)
    got = np.asarray(jax.device_get(out.batch.logprobs))[live]
    assert np.isfinite(got).all()
    # the same tokens scored by the bfloat16 model: equal up to bfloat16 rounding of the different op order
    np.testing.assert_allclose(got, _teacher_forced(bf16, out, 1.0)[live], atol=0.05, rtol=0)
    # by the float32 model: close, but not float32-close (the sampler did compute in bfloat16)
    diff = np.abs(got - _teacher_forced(f32, out, 1.0)[live])
    assert diff.mean() < 0.05 and diff.max() > 1e-3, (diff.mean(), diff.max())
