"""optim.optimizer: AdamW, Adam and SGD match torch.optim step for step; Lion matches its update rule in float64
NumPy; Adafactor matches transformers' (float64 torch) with its arguments from optim.override_optimizer_config;
an unknown name or argument stops finalize by key."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from rlhf_jax.config import base_config
from rlhf_jax.train.optim import make_optimizer

STEPS, LR, WD, BETAS, EPS = 3, 1e-2, 0.1, (0.9, 0.95), 1e-8


def _optim(**keys):
    """An ``optim`` section with the key table's defaults and ``keys`` set."""
    section = base_config().actor_rollout_ref.actor.optim
    section.update(keys)
    return section


def _ours(name, p0, grads):
    cfg = _optim(optimizer=name, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS, lr_warmup_steps=0)
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


def _adafactor_pair(shapes, settings, seed, steps=4):
    """(ours, transformers') parameters after ``steps`` Adafactor updates of random parameters and gradients."""
    from transformers.optimization import Adafactor

    rng = np.random.default_rng(seed)
    p0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[(rng.standard_normal(s) * 10.0 ** rng.uniform(-3, 0)).astype(np.float32) for s in shapes]
             for _ in range(steps)]
    cfg = _optim(optimizer="Adafactor", lr=LR, weight_decay=WD, lr_warmup_steps=0, override_optimizer_config=settings)
    tx, _ = make_optimizer(cfg, grad_clip=0.0, total_steps=steps, updates_per_step=1)
    params = [jnp.asarray(p) for p in p0]
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update([jnp.asarray(x) for x in g], state, params)
        params = optax.apply_updates(params, updates)
    torch_params = [torch.nn.Parameter(torch.tensor(p, dtype=torch.float64)) for p in p0]
    opt = Adafactor(torch_params, lr=LR, weight_decay=WD, **settings)
    for g in grads:
        for p, x in zip(torch_params, g):
            p.grad = torch.tensor(x, dtype=torch.float64)
        opt.step()
    return [np.asarray(p, np.float64) for p in params], [p.detach().numpy() for p in torch_params], p0


@pytest.mark.parametrize("settings", [
    dict(relative_step=False),  # transformers' defaults otherwise: factored, no first moment, parameter scale
    dict(relative_step=False, beta1=0.9, scale_parameter=False, clip_threshold=0.5, decay_rate=-0.6,
         eps=(1e-20, 1e-2)),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_adafactor_matches_transformers(settings, seed):
    # matrices both ways round (factored), a vector and a 3-D array whose last two axes are its largest
    shapes = [(6, 9), (9, 4), (7,), (2, 5, 8)]
    ours, theirs, p0 = _adafactor_pair(shapes, settings, seed)
    for shape, a, b, start in zip(shapes, ours, theirs, p0):
        assert not np.allclose(b, start, atol=1e-4), shape  # the steps moved it
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=str(shape))


def test_optimizer_arguments_are_honoured_or_refused_by_name(tmp_path):
    from rlhf_jax.config import finalize
    from rlhf_jax.train.optim import optimizer_settings
    from tests.train.helpers import make_config

    assert optimizer_settings("AdamW", {"fused": True, "amsgrad": False}) == {}
    assert optimizer_settings("adafactor", {"beta1": 0.8})["beta1"] == 0.8
    A = "actor_rollout_ref.actor.optim.override_optimizer_config"
    for optimizer, override, match in [
        ("AdamW", {"amsgrad": True}, rf"{A}\.amsgrad=True is not supported for AdamW"),
        ("SGD", {"momentum": 0.9}, rf"{A}\.momentum=0\.9 is not supported for SGD"),
        ("Adam", {"lr": 0.1}, rf"{A}\.lr: set optim\.lr instead"),
        ("Adafactor", {"relative_step": True}, rf"{A}\.relative_step=True .*set optim\.lr"),
        ("Adafactor", {"eps": 1e-30}, rf"{A}\.eps=1e-30: Adafactor's eps is a pair"),
        ("Lion", {"use_triton": True}, rf"{A}\.use_triton: Lion has no argument"),
    ]:
        cfg = make_config(str(tmp_path), actor_rollout_ref__actor__optim__optimizer=optimizer,
                          actor_rollout_ref__actor__optim__override_optimizer_config=override)
        with pytest.raises(ValueError, match=match):
            finalize(cfg, num_devices=8, check_paths=False)
    cfg = make_config(str(tmp_path), critic__optim__optimizer="Adafactor", critic__optim__betas=(0.8, 0.9))
    with pytest.raises(ValueError, match=r"critic\.optim\.betas=\(0\.8, 0\.9\).*Adafactor"):
        finalize(cfg, num_devices=8, check_paths=False)


def test_adafactor_state_on_a_sharded_model_gives_the_unsharded_update(tmp_path):
    """On a (data=2, fsdp=2, tensor=2) mesh the engine's optimizer-state shardings (a moment shaped like its
    parameter sharded like it, the factored row / column moments replicated) hold Adafactor's state, and an
    update there equals the same update on one device."""
    import jax

    from rlhf_jax import models
    from rlhf_jax.parallel import make_mesh
    from rlhf_jax.train.engine import Role
    from tests.conftest import build_hf_checkpoint

    build_hf_checkpoint("llama", str(tmp_path / "llama"))
    mesh = make_mesh(2, 2, 2)
    model = models.from_pretrained(str(tmp_path / "llama"), mesh=mesh, dtype=jnp.float32, param_dtype=jnp.float32)
    cfg = _optim(optimizer="Adafactor", lr=LR, weight_decay=WD, lr_warmup_steps=0,
               override_optimizer_config={"beta1": 0.9})
    tx, lr_fn = make_optimizer(cfg, grad_clip=1.0, total_steps=2, updates_per_step=1)
    role = Role(model, mesh, tx, lr_fn)
    sharded = [s for s in jax.tree.leaves(role.param_shardings) if any(a is not None for a in s.spec)]
    assert sharded and len(jax.tree.leaves(role.opt_state)) > len(jax.tree.leaves(role.params))
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p, s: jax.device_put(rng.standard_normal(p.shape).astype(np.float32), s),
                         role.params, role.param_shardings)
    step = jax.jit(tx.update, in_shardings=(role.param_shardings, role.opt_shardings, role.param_shardings),
                   out_shardings=(role.param_shardings, role.opt_shardings))
    updates, _ = step(grads, role.opt_state, role.params)
    local = lambda t: jax.tree.map(lambda x: np.asarray(x), t)  # noqa: E731
    want, _ = jax.jit(tx.update)(local(grads), jax.jit(tx.init)(local(role.params)), local(role.params))
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def _verl_lr_lambda(style: str, step: int, warmup: int, total: int, min_lr_ratio: float, num_cycles: float) -> float:
    """verl's get_cosine_schedule_with_warmup / get_wsd_schedule_with_warmup (stable_ratio 0.9) multipliers."""
    import math

    if step < warmup:
        return step / max(1, warmup)
    if style == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        x = math.cos(math.pi * num_cycles * 2.0 * progress)
        return max(min_lr_ratio, x * (1 - min_lr_ratio) * 0.5 + (1 + min_lr_ratio) * 0.5)
    stable = int((total - warmup) * 0.9)
    if step < warmup + stable:
        return 1.0
    if step < total:
        progress = (step - warmup - stable) / max(1, total - warmup - stable)
        value = max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))
        return (1.0 - min_lr_ratio) * value + min_lr_ratio
    return min_lr_ratio


@pytest.mark.parametrize("style", ["cosine", "wsd"])
def test_sft_schedules_match_verl(style):
    from rlhf_jax.train.optim import step_schedule

    total, warmup, lr = 57, 6, 3e-4
    schedule = step_schedule(lr, total, warmup=warmup, style=style, min_lr_ratio=0.1, num_cycles=0.5)
    for step in range(total + 1):
        expected = lr * _verl_lr_lambda(style, step, warmup, total, 0.1, 0.5)
        np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-5, atol=1e-12, err_msg=f"step {step}")
