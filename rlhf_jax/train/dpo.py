"""The DPO loop (``algorithm.type=dpo``): preference pairs -> reference log-probs -> DPO updates.

``DPOTrainer(cfg).fit()`` walks ``data.train_files``' (prompt, chosen, rejected) pairs in batches of
``data.train_batch_size`` pairs with the RL loop's grain loader, so a resume continues with the next batch of
the uninterrupted run. Each step computes the frozen reference's sequence log-probs of both responses, then
takes ``train_batch_size / actor.ppo_mini_batch_size`` optimizer steps with the DPO loss
(``algorithm.dpo.*``, :mod:`rlhf_jax.algos.dpo`), micro-batched by ``actor.ppo_micro_batch_size_per_gpu``
(pairs per shard; -1 = the whole mini-batch). The reference is a frozen copy of the initial weights, or under
LoRA the base model with the adapters off over the actor's own frozen arrays (no second copy).

Validation (``trainer.test_freq``, ``val_before_train``, ``val_only``) reports the loss and TRL's metrics on
``data.val_files``' pairs as ``val/...``. Checkpoints, resume, the HF export and the loggers are the run loop's
(train/fit_loop.py), as for every trainer. Batches are padded: every step has
the same shapes (the data's longest prompt, bucketed, and longest response, rounded up to a power of two),
so the update compiles once, before the first step, where the memory plan reads XLA's estimate.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from rlhf_jax.parallel import groups
from rlhf_jax.algos.dpo import dpo_loss
from rlhf_jax.batch.trim import trimmed_width
from rlhf_jax.config import finalize, with_dataset_size
from rlhf_jax.models.hub import resolve_model_path
from rlhf_jax.data.loader import PromptLoader
from rlhf_jax.data.preferences import PreferenceDataset, preference_dataset_from_config
from rlhf_jax.data.prompts import bucket_length, pad_left, pad_token_id_of, resolve_buckets
from rlhf_jax.train import metrics as M
from rlhf_jax.train.batching import mini_batches
from rlhf_jax.parallel.hosts import to_global
from rlhf_jax.train.dpo_steps import SIDES, DPOSpec, dpo_update, pair_specs, side
from rlhf_jax.train.engine import Role
from rlhf_jax.train.fit_loop import RunLoop
from rlhf_jax.train.passes import (HEADROOM, compiled_bytes, free_device_memory, gib)
from rlhf_jax.runtime.oom import memory_hint
from rlhf_jax.runtime.preemption import STOP, StopRequest
from rlhf_jax.train.setup import Components, actor_role, load_tokenizer, mesh_and_rules, reference_role
from rlhf_jax.train.trainer_checkpoints import CheckpointItems, export_policy, policy_items, restore_policy


def prepare(cfg: ConfigDict) -> tuple[Components, PreferenceDataset, PreferenceDataset | None]:
    """The finalized config, tokenizer, preference data and mesh of a DPO run (every check before any model)."""
    cfg = ConfigDict(cfg.to_dict()) if cfg.is_locked else cfg
    cfg.unlock()
    model_path = resolve_model_path(cfg.actor_rollout_ref.model.path, cfg.actor_rollout_ref.model.revision)
    cfg = finalize(cfg, num_devices=groups.device_count(), num_processes=groups.process_count())  # once, before data
    tokenizer_path = resolve_model_path(cfg.data.tokenizer) if cfg.data.tokenizer else model_path
    tokenizer = load_tokenizer(tokenizer_path, cfg.data.chat_template)
    train = preference_dataset_from_config(cfg.data, tokenizer, "train")
    val = preference_dataset_from_config(cfg.data, tokenizer, "val") if cfg.data.val_files else None
    cfg = with_dataset_size(cfg, len(train))
    mesh, rules = mesh_and_rules(cfg)
    c = Components(cfg, model_path, tokenizer_path, tokenizer, train.prompts, val.prompts if val else None, mesh, rules,
                   None, None)
    return c, train, val


def pad_right(rows: list[np.ndarray], length: int, pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token id rows to ``length``: (ids int32 [B, length], mask int32 [B, length])."""
    out = np.full((len(rows), length), pad_token_id, np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)], mask[i, :len(row)] = row, 1
    return out, mask


def dpo_spec(cfg: ConfigDict) -> DPOSpec:
    """The DPO loss settings of ``algorithm.dpo``."""
    dc = cfg.algorithm.dpo
    return DPOSpec(float(dc.beta), float(dc.label_smoothing), dc.loss_type, float(dc.kl_loss_coef), dc.kl_loss_type)


def pair_widths(cfg: ConfigDict, longest_prompt: int, longest_response: int) -> tuple[int, int]:
    """(prompt, response) columns of every batch of pairs whose longest prompt and response are these: fixed for
    the run, so each pass compiles once."""
    buckets = resolve_buckets(cfg.data.max_prompt_length, cfg.data.prompt_length_buckets)
    return bucket_length(longest_prompt, buckets), trimmed_width(longest_response, cfg.data.max_response_length)


def validation_rows(cfg: ConfigDict, processes: int) -> int:
    """Each process pads a validation batch of pairs to a multiple of this many rows (its shards)."""
    return max(int(cfg.derived.dp_size) // processes, 1)


def update_program(actor: Role, cfg: ConfigDict, spec: DPOSpec, widths: tuple[int, int]) -> Any:
    """The DPO update of one mini-batch of pairs of ``widths`` columns, compiled (``derived.actor_grad_accum_steps``
    micro-batches)."""
    d = cfg.derived
    specs = pair_specs(d.actor_mini_batch_size, *widths, kl=spec.kl_coef > 0)
    return actor.update_program("dpo_update", dpo_update, spec, specs, n_micro=d.actor_grad_accum_steps)


class DPOTrainer:
    """The DPO trainer (the ``fit_loop.Trainer`` protocol)."""

    def __init__(self, cfg: ConfigDict, stop: StopRequest = STOP, lock_dir: bool = False):
        """``lock_dir``: refuse at once if another run uses the output directory (``fit`` always checks)."""
        self.stop = stop
        c, self.train_data, self.val_data = prepare(cfg)
        self.c, self.cfg, self.mesh, self.tok = c, c.cfg, c.mesh, c.tokenizer
        cfg, d = self.cfg, self.cfg.derived
        ckpt = cfg.actor_rollout_ref.actor.checkpoint
        self.loop = RunLoop(cfg, stop, lock_dir, max_to_keep=cfg.trainer.max_actor_ckpt_to_keep,
                            checkpoint_contents=(tuple(ckpt.save_contents), tuple(ckpt.load_contents), None, None))
        self.actor = actor_role(cfg, c, self.loop.total_steps, d.actor_updates_per_step)
        self.ref = reference_role(cfg, c, self.actor)
        self.spec = dpo_spec(cfg)
        self.pad_id = pad_token_id_of(self.tok)
        self.loader = PromptLoader(self.train_data.prompts, cfg.data.train_batch_size, pad_token_id=self.pad_id,
                                   max_prompt_length=cfg.data.max_prompt_length, shuffle=cfg.data.shuffle,
                                   seed=cfg.data.seed, num_epochs=None)
        self.widths = {"train": self._widths(self.train_data)}
        if self.val_data is not None:
            self.widths["val"] = self._widths(self.val_data)
        self._update_program = None

    # ------------------------------------------------------------------ batches
    def _widths(self, data: PreferenceDataset) -> tuple[int, int]:
        """(prompt, response) columns of every batch of ``data``: fixed for the run, so each pass compiles once."""
        return pair_widths(self.cfg, *data.longest())

    def _host_pairs(self, data: PreferenceDataset, rows: np.ndarray, which: str) -> dict[str, np.ndarray]:
        """The process-local batch of pairs ``rows`` of ``data`` (see dpo_steps.py for the layout)."""
        P, R = self.widths[which]
        prompt, prompt_mask = pad_left([data.prompts.input_ids[i] for i in rows], P, self.pad_id)
        out = {}
        for s in SIDES:
            responses, response_mask = pad_right([getattr(data, s)[i] for i in rows], R, self.pad_id)
            out.update({f"{s}_input_ids": np.concatenate([prompt, responses], 1),
                        f"{s}_attention_mask": np.concatenate([prompt_mask, response_mask], 1),
                        f"{s}_responses": responses, f"{s}_response_mask": response_mask})
        return out

    def _sequence_log_probs(self, role: Role, batch: dict, name: str, n_micro: int, tokens: bool = False):
        """Summed response log-probs (B,) of one side of the pairs under ``role`` (with ``tokens``: and the
        per-token ones (B, R))."""
        one = side(batch, name)
        logp = role.log_probs(one, n_micro=n_micro, temperature=1.0)
        total = jnp.sum(logp * one.response_mask.astype(logp.dtype), axis=-1)
        return (total, logp.astype(jnp.float32)) if tokens else total

    # ------------------------------------------------------------------ memory plan
    def plan_memory(self) -> tuple[str, ...]:
        """Compile the update before the first step and stop, naming the keys, when XLA's estimate does not fit."""
        if self._update_program is not None:
            return ()
        n_micro = self.cfg.derived.actor_grad_accum_steps
        program = update_program(self.actor, self.cfg, self.spec, self.widths["train"])
        need, free = compiled_bytes(program), free_device_memory()
        if need is not None and free is not None and need > HEADROOM * free:
            raise MemoryError(
                f"the DPO update needs about {gib(need)} per device (XLA's estimate for micro-batches of "
                f"{self.cfg.derived.actor_mini_batch_size_per_shard // n_micro} pairs per shard), more than the "
                f"{gib(HEADROOM * free)} usable of {gib(free)} free: lower actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, "
                f"data.max_prompt_length / max_response_length, {memory_hint(self.cfg, 'actor')}")
        self.loop.logger.text(f"memory plan: dpo_update: {n_micro} micro-batch(es) per mini-batch, "
                              + (f"~{gib(need)} per device" if need is not None else "no estimate on this backend"))
        self._update_program = program
        return ()

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, Any]:
        """One step on the next batch of pairs: reference log-probs, then the DPO updates."""
        pb = next(self.loader)
        cfg, d = self.cfg, self.cfg.derived
        timer = M.Timer()
        with timer("step"):
            host = self._host_pairs(self.train_data, pb.index, "train")
            batch = {k: to_global(self.mesh, v) for k, v in host.items()}
            with timer("ref"):
                for s in SIDES:
                    if self.spec.kl_coef > 0:  # the KL loss compares each token with the reference's
                        batch[f"ref_{s}"], batch[f"ref_{s}_tokens"] = self._sequence_log_probs(
                            self.ref, batch, s, d.ref_micro_batches, tokens=True)
                    else:
                        batch[f"ref_{s}"] = self._sequence_log_probs(self.ref, batch, s, d.ref_micro_batches)
                jax.block_until_ready(batch["ref_rejected"])
            self.plan_memory()
            num = d.actor_num_mini_batches
            perm = (np.random.default_rng([int(cfg.trainer.seed), step, 0, 0]).permutation(d.rollout_batch_size)
                    if cfg.actor_rollout_ref.actor.shuffle else None)
            collected: dict[str, list] = {}
            with timer("update_actor"):
                for mb in mini_batches(self.mesh, batch, num, perm):
                    for k, v in self.actor.apply_program(self._update_program, mb).items():
                        collected.setdefault(k, []).append(v)
                out = {k: float(np.mean([float(x) for x in v])) for k, v in collected.items()}
        tokens = int(sum(host[f"{s}_attention_mask"].sum() for s in SIDES))
        out.update(M.timing_metrics(timer.seconds, response_tokens=tokens, total_tokens=tokens))
        out.update({"perf/total_num_tokens": float(tokens), "actor/lr": float(self.actor.lr_fn(step)),
                    "training/global_step": step + 1, "training/epoch": pb.epoch})
        return out

    # ------------------------------------------------------------------ validation
    def validate(self, step: int) -> dict[str, float]:
        """Loss and TRL's metrics over the validation pairs (``val/...``), each pair counted once."""
        if self.val_data is None:
            return {}
        cfg = self.cfg
        loader = PromptLoader(self.val_data.prompts, cfg.data.val_batch_size or len(self.val_data),
                              pad_token_id=self.pad_id, max_prompt_length=cfg.data.max_prompt_length, shuffle=False,
                              num_epochs=1, drop_remainder=False)
        rows_per_shard = validation_rows(cfg, groups.process_count())
        totals: dict[str, float] = {}
        count = 0.0
        for pb in loader:
            if self.stop.agreed():  # partial metrics would mislead
                return {}
            real = len(pb.index)
            rows = np.concatenate([pb.index, np.repeat(pb.index[:1], -real % rows_per_shard)])  # whole shards
            batch = {k: to_global(self.mesh, v) for k, v in self._host_pairs(self.val_data, rows, "val").items()}
            logps = {f"{who}_{s}": self._sequence_log_probs(role, batch, s, 1)
                     for who, role in (("policy", self.actor), ("ref", self.ref)) for s in SIDES}
            weights = to_global(self.mesh, (np.arange(len(rows)) < real).astype(np.float32))
            _, metrics = dpo_loss(logps["policy_chosen"], logps["policy_rejected"], logps["ref_chosen"],
                                  logps["ref_rejected"], beta=self.spec.beta, label_smoothing=self.spec.label_smoothing,
                                  loss_type=self.spec.loss_type, weights=weights)
            n = float(jnp.sum(weights))  # the batch's counted pairs (global arrays: every process's rows)
            count += n
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v) * n
        return {f"val/{'dpo_loss' if k == 'loss' else k}": v / max(count, 1.0) for k, v in totals.items()}

    # ------------------------------------------------------------------ checkpoints and the loop's other calls
    def checkpoint_items(self, saved: dict | None = None) -> CheckpointItems:
        return policy_items(self.actor, self.cfg, self.c, self.loader)

    def restore(self, arrays: dict[str, Any], state: dict | None) -> None:
        restore_policy(arrays, state, self.actor, self.loader)

    def export_hf(self, step: int) -> str:
        return export_policy(self.actor, self.loop.out_dir, step, self.tok, self.c.model_path)

    def fit(self) -> dict[str, Any]:
        return self.loop.fit(self)

    def out_of_memory(self, error: BaseException) -> str | None:
        return self.loop.out_of_memory(error)

    def close(self) -> None:
        self.loop.close()
