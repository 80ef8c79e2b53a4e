"""Where and when a run computes: the devices it uses (verl's nnodes x n_gpus_per_node), the training mesh's share
when the rollout has devices of its own, the experience schedule (buffer, overlap, staleness bound) and the
actor-critic shared trunk. Called by :func:`rlhf_jax.config.validate.finalize`; every error names its key.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from rlhf_jax.config import schema


def used_devices(cfg: ConfigDict, num_devices: int, num_processes: int) -> int:
    """Devices the run uses (verl's ``trainer.nnodes`` x ``n_gpus_per_node``; None = every one found).

    A node is a JAX process here (one per host); ``n_gpus_per_node`` takes the first devices of each.
    """
    t = cfg.trainer
    if t.nnodes is not None and t.nnodes != num_processes:
        raise ValueError(f"trainer.nnodes={t.nnodes}, but this run has {num_processes} JAX process(es) (one per "
                         f"node): start {t.nnodes} processes (launch/) or set trainer.nnodes={num_processes}")
    per_process = num_devices // num_processes
    if t.n_gpus_per_node is None:
        return num_devices
    if not 0 < t.n_gpus_per_node <= per_process:
        raise ValueError(f"trainer.n_gpus_per_node={t.n_gpus_per_node}, but {per_process} device(s) were found per "
                         f"process: set it to at most {per_process} (or leave it unset to use them all)")
    return t.n_gpus_per_node * num_processes


def train_devices(cfg: ConfigDict, num_devices: int, num_processes: int) -> int:
    """Devices of the training mesh: all of them, or those left after ``mesh.rollout_devices``."""
    k = cfg.mesh.rollout_devices
    if k == 0:
        return num_devices
    if not 0 < k < num_devices:
        raise ValueError(f"mesh.rollout_devices={k} must be 0 (shared devices) or in [1, {num_devices - 1}]: "
                         f"{num_devices} devices are available and training needs at least one")
    if num_processes > 1:
        raise ValueError(f"mesh.rollout_devices={k}: separate rollout devices run in one process; this run has "
                         f"{num_processes} (set mesh.rollout_devices=0)")
    prompts = cfg.data.train_batch_size
    if prompts % k:
        raise ValueError(f"mesh.rollout_devices={k} must divide data.train_batch_size={prompts} (the sampler splits "
                         "the prompts over its devices)")
    return num_devices - k


# Critic settings a shared trunk does not use: the actor's model, optimizer and mini-batches train the value head.
_SEPARATE_CRITIC_ONLY = ("critic.optim.lr", "critic.optim.weight_decay", "critic.optim.optimizer", "critic.grad_clip",
                         "critic.model.enable_gradient_checkpointing", "trainer.critic_warmup")


def check_shared_trunk(cfg: ConfigDict) -> None:
    """critic.shared_trunk: a value head on the actor; the settings of a separate critic must stay unset."""
    c = cfg.critic
    if not c.shared_trunk:
        return
    if not c.enable:
        raise ValueError("critic.shared_trunk=True puts a value head on the actor, but no value model is trained "
                         f"(critic.enable=False, algorithm.adv_estimator={cfg.algorithm.adv_estimator}): use gae")
    if c.model.path != cfg.actor_rollout_ref.model.path:
        raise ValueError(f"critic.model.path={c.model.path!r}: with critic.shared_trunk the value head sits on the "
                         "actor's trunk; leave critic.model.path unset")
    if cfg.actor_rollout_ref.model.lora_rank:
        raise ValueError("critic.shared_trunk=True with actor_rollout_ref.model.lora_rank > 0 is not supported "
                         "(the value head would train through frozen weights): use a separate critic")
    for path in _SEPARATE_CRITIC_ONLY:
        value = schema.get_path(cfg, path)
        if value != schema.get_key(path).default:
            raise ValueError(f"{path}={value!r} applies to a separate critic; with critic.shared_trunk the actor's "
                             "optimizer, mini-batches and remat train the value head (set the actor's keys)")


def check_experience(cfg: ConfigDict) -> None:
    """The experience schedule (train/experience.py): sizes, the overlap's devices, the staleness bound."""
    e = cfg.experience
    if e.buffer_size < 1:
        raise ValueError(f"experience.buffer_size={e.buffer_size} must be >= 1 (1 = train on each batch as it is "
                         "sampled)")
    if e.max_staleness is not None and e.max_staleness < 0:
        raise ValueError(f"experience.max_staleness={e.max_staleness} must be >= 0 (0 = strictly on-policy) or None")
    if e.overlap and cfg.mesh.rollout_devices == 0:
        raise ValueError("experience.overlap=True samples while the training devices update, so the rollout needs "
                         "devices of its own: set mesh.rollout_devices (e.g. half of the devices)")
    lag = 2 * e.buffer_size - 1 if e.overlap else e.buffer_size - 1
    if e.max_staleness is not None and lag > e.max_staleness:
        raise ValueError(f"experience.max_staleness={e.max_staleness}: experience.buffer_size={e.buffer_size} with "
                         f"experience.overlap={e.overlap} trains batches up to {lag} updates after their weights")
    if (e.buffer_size > 1 or e.overlap) and cfg.algorithm.filter_groups.enable:
        raise ValueError("algorithm.filter_groups.enable=True samples extra batches within a step; it needs "
                         "experience.buffer_size=1 and experience.overlap=False")
