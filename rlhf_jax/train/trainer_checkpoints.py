"""The trainer's checkpoints: what a step saves (per ``checkpoint.save_contents``), how a run resumes (per
``load_contents``, setting aside unreadable checkpoints under ``resume_mode=auto``), and the HF export.

A mixin of ``Trainer``: it reads the trainer's roles, loader, KL controller and checkpointer.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import jax.numpy as jnp
import numpy as np

from rlhf_jax.models import lora, save_pretrained
from rlhf_jax.models.lora_peft import ADAPTER_DIR, save_adapter
from rlhf_jax.parallel import batch_sharding
from rlhf_jax.train import experience
from rlhf_jax.runtime import ckpt_contents
from rlhf_jax.parallel.hosts import sum_over_processes
from rlhf_jax.runtime.checkpoint import (CheckpointError, Checkpointer, CheckpointReadError, quiet_storage_noise,
                                         resolve_resume)


class CheckpointMixin:
    def _extra_state(self) -> dict:
        state = {
            "step": self.step,
            "epoch": self.step // max(self.cfg.derived.steps_per_epoch, 1),
            "seed": int(self.cfg.trainer.seed),
            "model": {"hf_config": self.actor.config.hf_config, "task": self.actor.task,
                      "tokenizer_path": self.c.tokenizer_path,
                      "param_dtype": self.cfg.actor_rollout_ref.model.dtype,
                      "lora": dataclasses.asdict(self.lora) if self.lora else None,
                      "base_model_path": self.c.model_path},
        }
        if "extra" in self.cfg.actor_rollout_ref.actor.checkpoint.save_contents:
            _, pending, data_state = self._pending_for_checkpoint()
            state.update(kl_coef=float(self.kl_ctrl["value"]), data_state=data_state, pending=pending)
        return state

    def _role_arrays(self) -> dict[str, Any]:
        """Every checkpointable array tree of this run, by checkpoint item name."""
        # Frozen parameters too (the export tool reads them here), except the base weights of a LoRA run: those are
        # the base model's, read again from its directory.
        arrays = {"actor_params": self.actor.params if self.lora else self.actor.state(), "actor_opt": self.actor.opt_state}
        if self.critic is not None:
            arrays.update(critic_params=self.critic.params, critic_opt=self.critic.opt_state)
        return arrays

    def _contents(self, which: str) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
        """(actor, critic) checkpoint contents (``save_contents`` or ``load_contents``); critic None without one."""
        actor = self.cfg.actor_rollout_ref.actor.checkpoint[which]
        return tuple(actor), (tuple(self.cfg.critic.checkpoint[which]) if self.critic is not None else None)

    def save_checkpoint(self) -> None:
        everything = self._role_arrays()
        arrays = {item: everything[item] for item in ckpt_contents.array_items(*self._contents("save_contents"))}
        if "extra" in self._contents("save_contents")[0] and self._pending:  # sampled, not yet trained on
            arrays["experience"] = self._pending_for_checkpoint()[0]
        self.checkpointer.save(self.step, arrays, {**self._extra_state(), "items": sorted(arrays)})

    def maybe_resume(self) -> None:
        """Restore the checkpoint resume_mode names. Under ``auto`` a checkpoint that cannot be read (deleted
        files, damaged data) is moved aside as ``<step>.unreadable`` and the previous complete one is used."""
        t = self.cfg.trainer
        root, step = resolve_resume(self.checkpointer.directory, t.resume_mode, t.resume_from_path)
        own = root == self.checkpointer.directory
        while step is not None:
            ckpt = self.checkpointer if own else Checkpointer(root, async_save=False)
            with quiet_storage_noise() as quiet:
                try:
                    extra, restored = self._read_checkpoint(ckpt, step)
                    problem = None
                except CheckpointReadError as e:  # any damage, whatever layer of Orbax notices it
                    problem = str(e)
                    quiet.drain()
                except Exception as e:  # noqa: BLE001 - a checkpoint that reads but does not fit this run
                    problem = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            if not sum_over_processes(np.asarray([problem is not None], np.int64))[0]:
                break
            problem = problem or "on another process"
            if not (own and t.resume_mode == "auto"):
                raise CheckpointError(f"checkpoint {root}/{step} cannot be read: {problem}")
            aside = self.checkpointer.set_aside(step)
            previous = self.checkpointer.latest_step()
            if self.is_main:
                print(f"warning: checkpoint {root}/{step} cannot be read: {problem}; moved to {aside}, "
                      + (f"resuming from step {previous}" if previous is not None else "starting from step 0"),
                      file=sys.stderr, flush=True)
            step = previous
        if step is None:
            return
        if "actor_params" in restored:
            self.actor.load_trained(restored["actor_params"])
        self.actor.opt_state = restored.get("actor_opt", self.actor.opt_state)
        if self.critic is not None:
            self.critic.params = restored.get("critic_params", self.critic.params)
            self.critic.opt_state = restored.get("critic_opt", self.critic.opt_state)
        actor_load, critic_load = self._contents("load_contents")
        if ckpt_contents.restores_extra(actor_load, extra):
            self.kl_ctrl = {**self.kl_ctrl, "value": jnp.asarray(extra["kl_coef"], jnp.float32)}
            self.loader.set_state(extra["data_state"])
            self._restore_pending(restored.get("experience", {}), extra.get("pending", []))
        self.step = int(extra["step"])
        _, lacking = ckpt_contents.items_to_restore(actor_load, critic_load, ckpt_contents.saved_items(extra))
        fresh = lacking + ([] if ckpt_contents.restores_extra(actor_load, extra) else ["data position, KL coefficient"])
        self.logger.text(f"resumed from {root}/{step} (step {self.step})"
                         + (f"; not restored (load_contents / saved without them): {', '.join(fresh)}" if fresh else ""))

    def _read_checkpoint(self, ckpt: Checkpointer, step: int) -> tuple[dict, dict]:
        """(extra, arrays) of one checkpoint; changes nothing, so a failure leaves the trainer as it was."""
        extra = ckpt.restore_extra(step)
        items, _ = ckpt_contents.items_to_restore(*self._contents("load_contents"), ckpt_contents.saved_items(extra))
        everything = self._role_arrays()
        templates = {item: everything[item] for item in items}
        if extra.get("pending") and ckpt_contents.restores_extra(self._contents("load_contents")[0], extra):
            templates["experience"] = experience.templates(
                extra["pending"], lambda ndim: batch_sharding(self.mesh, ndim, self.c.rules))
        return extra, ckpt.restore_arrays(step, templates) if templates else {}

    def export_hf(self) -> str:
        """The actor as a plain HF directory (adapters merged); with LoRA also the adapter alone in PEFT's layout
        (``<dir>/lora_adapter``)."""
        out = os.path.join(self.out_dir, "hf", f"global_step_{self.step}")
        model = self.actor.model()
        save_pretrained(lora.merged_model(model), out, tokenizer=self.tok, copy_from=self.c.model_path)
        if self.lora:
            save_adapter(model, os.path.join(out, ADAPTER_DIR), base_model=self.c.model_path)
        return out

