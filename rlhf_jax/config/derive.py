"""Batch arithmetic: how one training step splits into mini-batches, micro-batches and shards.

verl's conventions: ``data.train_batch_size`` and ``ppo_mini_batch_size`` count
prompts, each sampled ``rollout.n`` times, so both are multiplied by n; the
``*_per_gpu`` micro-batch sizes count sequences on one data-parallel shard.
Here a shard is one position on the ``data`` x ``fsdp`` mesh axes (devices on
the ``tensor`` axis share their shard's batch), so a global micro-batch is
``micro x dp`` sequences and a mini-batch takes
``mini x n / (micro x dp)`` accumulation steps. A micro-batch size of -1 means the
whole per-shard batch in one pass (no accumulation), whatever the device count; the
memory plan (``train/passes.py``) may then choose smaller micro-batches.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from rlhf_jax import algos

DERIVED_DOCS: dict[str, str] = {
    "derived.num_devices": "Devices in the mesh.",
    "derived.num_processes": "JAX processes (hosts).",
    "derived.mesh_shape": "(data, fsdp, tensor, expert, context) axis sizes with -1 resolved.",
    "derived.dp_size": "Data-parallel shards = mesh data x fsdp x expert (the batch is split over all three).",
    "derived.rollout_batch_size": "Sequences per step = data.train_batch_size x rollout.n.",
    "derived.rollout_batch_size_per_shard": "Sequences per step on one data-parallel shard.",
    "derived.prompts_per_process": "Prompts each process loads per step = train_batch_size / num_processes.",
    "derived.max_seq_len": "data.max_prompt_length + rollout.response_length.",
    "derived.need_ref": "A reference model is needed (actor.use_kl_loss, algorithm.use_kl_in_reward, or the "
                        "distillation teacher in its place).",
    "derived.recompute_old_log_prob": "Old log-probs need a forward pass (false only for 1 mini-batch x 1 epoch).",
    "derived.sum_pi_squared": "The old-log-prob pass also returns sum_v pi_v^2 per token (actor.calculate_sum_pi_squared, "
                              "or an estimator that reads it: optimal_token_baseline, tir_optimal_token_baseline).",
    "derived.actor_mini_batch_size": "Sequences per actor mini-batch = ppo_mini_batch_size x rollout.n.",
    "derived.actor_num_mini_batches": "Actor optimizer steps per PPO epoch.",
    "derived.actor_mini_batch_size_per_shard": "Sequences of one actor mini-batch on one shard.",
    "derived.actor_grad_accum_steps": "Micro-batches per actor mini-batch (gradient accumulation).",
    "derived.actor_updates_per_step": "Actor optimizer steps per training step = mini-batches x ppo_epochs.",
    "derived.log_prob_micro_batches": "Micro-batches of the old-log-prob pass on each shard.",
    "derived.ref_micro_batches": "Micro-batches of the reference pass on each shard.",
    "derived.critic_mini_batch_size": "Sequences per critic mini-batch (0 without a critic).",
    "derived.critic_num_mini_batches": "Critic optimizer steps per critic epoch (0 without a critic).",
    "derived.critic_grad_accum_steps": "Micro-batches per critic mini-batch (0 without a critic).",
    "derived.critic_forward_micro_batches": "Micro-batches of the value pass on each shard (0 without a critic).",
    "derived.critic_updates_per_step": "Critic optimizer steps per training step (0 without a critic).",
    "derived.steps_per_epoch": "Training steps per epoch = dataset size // train_batch_size (-1: size unknown).",
    "derived.total_training_steps": "Steps to run: trainer.total_training_steps, else epochs x steps_per_epoch (-1).",
    "derived.actor_lr_warmup_steps": "Actor warmup steps: lr_warmup_steps, else ratio x total steps (-1: unknown).",
    "derived.critic_lr_warmup_steps": "Critic warmup steps, same rule (-1: unknown).",
    "derived.model_max_position_embeddings": "The policy's context length from its config.json (-1: unknown).",
    "derived.model_vocab_size": "The policy's vocabulary size from its config.json (-1: unknown).",
}


def _divides(what: str, total: int, part: int, fix: str) -> int:
    if part <= 0 or total % part:
        raise ValueError(f"{what}: {total} is not divisible by {part}; {fix}")
    return total // part


SUPERVISED = ("sft",)  # algorithm.type values whose trainer takes one optimizer step per batch of examples
WHOLE = -1  # a *_micro_batch_size_per_gpu of -1: the whole per-shard batch in one pass (no accumulation)


def _role_split(prefix: str, mini_prompts: int, micro: int, n: int, train: int, dp: int) -> tuple[int, int, int]:
    """(mini-batch sequences, mini-batches per epoch, accumulation steps) of actor or critic, checked."""
    _divides(f"data.train_batch_size ({train}) vs {prefix}.ppo_mini_batch_size", train, mini_prompts,
             f"set {prefix}.ppo_mini_batch_size to a divisor of data.train_batch_size={train}")
    mini_seqs = mini_prompts * n
    if micro == WHOLE:
        micro = max(mini_seqs // dp, 1)
    accum = _divides(
        f"{prefix}.ppo_mini_batch_size x rollout.n = {mini_prompts} x {n} sequences vs "
        f"{prefix}.ppo_micro_batch_size_per_gpu ({micro}) x data-parallel shards ({dp})",
        mini_seqs, micro * dp,
        f"make {prefix}.ppo_micro_batch_size_per_gpu x {dp} divide {mini_seqs} (e.g. a smaller micro-batch, "
        "a larger ppo_mini_batch_size, or fewer data/fsdp devices)")
    return mini_seqs, train // mini_prompts, accum


def _warmup(steps: int, ratio: float, total: int) -> int:
    if steps >= 0:
        return steps
    return int(ratio * total) if total > 0 else (0 if ratio == 0 else -1)


def derive_batches(
    cfg: ConfigDict,
    *,
    mesh: tuple[int, int, int, int, int],
    num_devices: int,
    num_processes: int,
    train_dataset_size: int | None,
) -> ConfigDict:
    """The ``derived`` section (see :data:`DERIVED_DOCS`); raises ValueError on sizes that do not divide."""
    arr = cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    train, n = cfg.data.train_batch_size, rollout.n
    rl = cfg.algorithm.type not in SUPERVISED
    if not rl:  # one sequence per example, one optimizer step per batch: the RL splits do not apply
        n = 1
    dp = mesh[0] * mesh[1] * mesh[3]
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.expert, cfg.mesh.context = mesh
    d = ConfigDict()
    d.num_devices, d.num_processes, d.mesh_shape, d.dp_size = num_devices, num_processes, tuple(mesh), dp
    d.prompts_per_process = _divides(
        f"data.train_batch_size ({train}) vs {num_processes} processes", train, num_processes,
        "make data.train_batch_size a multiple of the number of processes")
    d.rollout_batch_size = train * n
    d.rollout_batch_size_per_shard = _divides(
        f"data.train_batch_size x rollout.n = {train} x {n} sequences vs {dp} data-parallel shards (mesh data x fsdp)",
        train * n, dp, "make data.train_batch_size x actor_rollout_ref.rollout.n a multiple of mesh.data x mesh.fsdp x mesh.expert")
    d.max_seq_len = cfg.data.max_prompt_length + rollout.response_length
    d.need_ref = bool(actor.use_kl_loss or cfg.algorithm.use_kl_in_reward or cfg.distillation.enabled)
    d.sum_pi_squared = bool(rl and (actor.calculate_sum_pi_squared or algos.estimator_info(
        cfg.algorithm.adv_estimator).needs_sum_pi_squared))

    if not rl:
        _supervised(d, train, dp)
    else:
        _rl_splits(d, cfg, train, n, dp)
    derive_steps(d, cfg, train_dataset_size)
    d.model_max_position_embeddings = -1  # read from the model's config.json by finalize
    d.model_vocab_size = -1
    return d


def _supervised(d: ConfigDict, train: int, dp: int) -> None:
    """The RL fields of a supervised run (its trainer splits its batch itself): one update of the whole batch."""
    d.need_ref, d.recompute_old_log_prob = False, False
    d.actor_mini_batch_size, d.actor_num_mini_batches, d.actor_grad_accum_steps = train, 1, 1
    d.actor_mini_batch_size_per_shard, d.actor_updates_per_step = train // dp, 1
    d.log_prob_micro_batches = d.ref_micro_batches = 1
    d.critic_mini_batch_size = d.critic_num_mini_batches = d.critic_grad_accum_steps = 0
    d.critic_forward_micro_batches = d.critic_updates_per_step = 0


def _rl_splits(d: ConfigDict, cfg: ConfigDict, train: int, n: int, dp: int) -> None:
    arr = cfg.actor_rollout_ref
    actor, rollout, critic = arr.actor, arr.rollout, cfg.critic
    a = "actor_rollout_ref.actor"
    mini_seqs, num_mini, accum = _role_split(a, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
                                             n, train, dp)
    d.actor_mini_batch_size, d.actor_num_mini_batches, d.actor_grad_accum_steps = mini_seqs, num_mini, accum
    d.actor_mini_batch_size_per_shard = mini_seqs // dp
    d.actor_updates_per_step = num_mini * actor.ppo_epochs
    d.recompute_old_log_prob = not (num_mini == 1 and actor.ppo_epochs == 1)
    per_shard = d.rollout_batch_size_per_shard
    whole = lambda micro: per_shard if micro == WHOLE else micro  # noqa: E731
    d.log_prob_micro_batches = _divides(
        f"{per_shard} sequences per shard vs actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        per_shard, whole(rollout.log_prob_micro_batch_size_per_gpu),
        f"set actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu to a divisor of {per_shard}")
    d.ref_micro_batches = _divides(
        f"{per_shard} sequences per shard vs actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        per_shard, whole(arr.ref.log_prob_micro_batch_size_per_gpu),
        f"set actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu to a divisor of {per_shard}")

    if critic.enable:
        c_seqs, c_num, c_accum = _role_split("critic", critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu,
                                             n, train, dp)
        c_fwd = _divides(f"{per_shard} sequences per shard vs critic.forward_micro_batch_size_per_gpu", per_shard,
                         whole(critic.forward_micro_batch_size_per_gpu),
                         f"set critic.forward_micro_batch_size_per_gpu to a divisor of {per_shard}")
        c_updates = c_num * critic.ppo_epochs
    else:
        c_seqs = c_num = c_accum = c_fwd = c_updates = 0
    d.critic_mini_batch_size, d.critic_num_mini_batches, d.critic_grad_accum_steps = c_seqs, c_num, c_accum
    d.critic_forward_micro_batches, d.critic_updates_per_step = c_fwd, c_updates


def derive_steps(d: ConfigDict, cfg: ConfigDict, train_dataset_size: int | None) -> None:
    """Steps per epoch, steps to run and warmup steps into ``d`` (-1 where the training set's size is needed)."""
    actor, critic, train = cfg.actor_rollout_ref.actor, cfg.critic, cfg.data.train_batch_size
    if train_dataset_size is not None:
        d.steps_per_epoch = train_dataset_size // train
        if d.steps_per_epoch == 0:
            raise ValueError(f"the training data has {train_dataset_size} prompts, fewer than data.train_batch_size="
                             f"{train}; lower data.train_batch_size or add data")
    else:
        d.steps_per_epoch = -1
    if cfg.trainer.total_training_steps is not None:
        d.total_training_steps = cfg.trainer.total_training_steps
    elif d.steps_per_epoch > 0:
        d.total_training_steps = d.steps_per_epoch * cfg.trainer.total_epochs
    else:
        d.total_training_steps = -1
    total = d.total_training_steps
    d.actor_lr_warmup_steps = _warmup(actor.optim.lr_warmup_steps, actor.optim.lr_warmup_steps_ratio, total)
    d.critic_lr_warmup_steps = _warmup(critic.optim.lr_warmup_steps, critic.optim.lr_warmup_steps_ratio, total)
