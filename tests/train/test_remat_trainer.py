"""A trainer run with gradient checkpointing on: the checkpointed layers run inside the jitted, mapped steps."""

import math

from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config


def test_grpo_with_gradient_checkpointing_completes_two_steps(tmp_path):
    cfg = make_config(str(tmp_path), "grpo", **{"actor_rollout_ref.model.enable_gradient_checkpointing": True})
    last = Trainer(cfg).fit()
    assert last["training/global_step"] == 2
    for name in ("actor/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert math.isfinite(last[name]), name
    assert last["actor/grad_norm"] > 0
