"""A training run compiles each of its programs once: later steps trace and compile nothing."""

import jax

from rlhf_jax.train.trainer import Trainer
from tests.train.helpers import make_config


def test_steps_after_the_first_compile_nothing(tmp_path):
    traces: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "trace" in event or "compile" in event or "lower" in event:
            traces.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        # ppo: sampler, reference, critic values and update, actor log-probs and update all run every step.
        trainer = Trainer(make_config(str(tmp_path), "ppo", **{"trainer.total_training_steps": 4}))
        counts = []
        for step in range(4):
            trainer.train_on(next(trainer.loader), step)
            counts.append(len(traces))
        trainer.close()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert counts[0] > 0  # the listener sees compilations
    assert counts[1] == counts[2] == counts[3], counts
