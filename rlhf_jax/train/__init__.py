"""Training: train state and optimizer, jitted steps, the trainer loop, checkpoints, metrics."""


def run(cfg):
    """Train with ``cfg`` (a recipe's get_config() plus overrides); returns the last step's metrics."""
    from rlhf_jax.train.trainer import Trainer

    return Trainer(cfg).fit()


__all__ = ["run"]
