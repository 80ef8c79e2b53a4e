"""optim.optimizer: AdamW, Adam and SGD match torch.optim step for step; Lion matches its update rule in float64
NumPy; an unknown name stops finalize by key."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from rlhf_jax.train.optim import make_optimizer

STEPS, LR, WD, BETAS, EPS = 3, 1e-2, 0.1, (0.9, 0.95), 1e-8


def _ours(name, p0, grads):
    cfg = dict(optimizer=name, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS, lr_warmup_steps=0)
    tx, _ = make_optimizer(cfg, grad_clip=0.0, total_steps=STEPS, updates_per_step=1)
    params, state = jnp.asarray(p0), None
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(jnp.asarray(g), state, params)
        params = optax.apply_updates(params, updates)
    return np.asarray(params, np.float64)


def _torch(cls, p0, grads, **kw):
    p = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    opt = cls([p], lr=LR, weight_decay=WD, **kw)
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return p.detach().numpy()


def _lion(p0, grads):
    p, m = p0.astype(np.float64), np.zeros_like(p0, np.float64)
    for g in grads:
        c = BETAS[0] * m + (1 - BETAS[0]) * g
        p = p - LR * (np.sign(c) + WD * p)
        m = BETAS[1] * m + (1 - BETAS[1]) * g
    return p


@pytest.mark.parametrize("seed", [0, 1])
def test_optimizers_match_their_definitions(seed):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(17).astype(np.float32)
    grads = [rng.standard_normal(17).astype(np.float32) for _ in range(STEPS)]
    want = {
        "AdamW": _torch(torch.optim.AdamW, p0, grads, betas=BETAS, eps=EPS),
        "adam": _torch(torch.optim.Adam, p0, grads, betas=BETAS, eps=EPS),
        "SGD": _torch(torch.optim.SGD, p0, grads),
        "Lion": _lion(p0, grads),
    }
    for name, expected in want.items():
        np.testing.assert_allclose(_ours(name, p0, grads), expected, rtol=1e-5, atol=1e-6, err_msg=name)
    assert not np.allclose(want["AdamW"], want["adam"], atol=1e-6)  # decoupled vs L2 decay tell apart


def test_unknown_optimizer_is_refused_by_key(tmp_path):
    from rlhf_jax.config import finalize
    from tests.train.helpers import make_config

    cfg = make_config(str(tmp_path), critic__optim__optimizer="RMSprop")
    with pytest.raises(ValueError, match=r"critic\.optim\.optimizer='RMSprop'"):
        finalize(cfg, num_devices=8, check_paths=False)
