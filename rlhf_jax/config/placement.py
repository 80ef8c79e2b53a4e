"""Where and when a run computes: the devices it uses (verl's nnodes x n_gpus_per_node), the training mesh's share
when the rollout has devices of its own. Called by :func:`rlhf_jax.config.validate.finalize`; every error names its key (the rules
on the experience schedule and the shared trunk are in :mod:`rlhf_jax.config.rules_run`).
"""

from __future__ import annotations

from ml_collections import ConfigDict



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
    """Devices of the training mesh: all of them, or those left after ``mesh.rollout_devices`` or the sampling
    processes of ``mesh.rollout_processes``."""
    if cfg.mesh.rollout_processes:
        return _split_train_devices(cfg, num_devices, num_processes)
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


def _split_train_devices(cfg: ConfigDict, num_devices: int, num_processes: int) -> int:
    k = cfg.mesh.rollout_processes
    if not 0 < k < num_processes:
        raise ValueError(f"mesh.rollout_processes={k} must be in [1, {num_processes - 1}]: this run has "
                         f"{num_processes} JAX process(es) and training needs at least one (launch/)")
    if cfg.mesh.rollout_devices:
        raise ValueError(f"mesh.rollout_processes={k} and mesh.rollout_devices={cfg.mesh.rollout_devices}: "
                         "choose one way to give sampling devices of its own")
    per_process = num_devices // num_processes
    sampling = k * per_process
    prompts = cfg.data.train_batch_size
    if prompts % sampling:
        raise ValueError(f"mesh.rollout_processes={k}: its {sampling} devices must divide data.train_batch_size="
                         f"{prompts} (the sampler splits the prompts over them)")
    return num_devices - sampling
