"""The checkpoint service: it saves what a trainer's ``checkpoint_items()`` holds (per the roles'
``checkpoint.save_contents``), and resumes a run (per ``load_contents``, setting aside unreadable checkpoints
under ``resume_mode=auto``). It reads nothing of a trainer but its items, and hands the restored ones back
through ``trainer.restore``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import numpy as np

from rlhf_jax.models import lora, save_pretrained
from rlhf_jax.models.lora_peft import ADAPTER_DIR, save_adapter
from rlhf_jax.runtime import ckpt_contents
from rlhf_jax.parallel.hosts import sum_over_processes
from rlhf_jax.runtime.checkpoint import CheckpointError, Checkpointer, CheckpointReadError, resolve_resume
from rlhf_jax.runtime.storage_noise import quiet_storage_noise


@dataclasses.dataclass
class CheckpointItems:
    """What a trainer checkpoints."""

    arrays: dict[str, Any]  # model and optimizer array trees by item name (ckpt_contents.ARRAY_ITEMS)
    model: dict  # the policy's description (what the export tool needs to rebuild it)
    state: dict  # the trainer's JSON state beyond the weights (the data position, ...), saved with "extra"
    required: tuple[str, ...]  # the fields of ``state`` a resume needs to restore it
    state_arrays: dict[str, Any] = dataclasses.field(default_factory=dict)  # array state saved with "extra"


def model_record(actor, cfg, c) -> dict:
    """The description of the actor a checkpoint records (``c``: the run's components)."""
    return {"hf_config": actor.config.hf_config, "task": actor.task, "tokenizer_path": c.tokenizer_path,
            "param_dtype": cfg.actor_rollout_ref.model.dtype,
            "lora": dataclasses.asdict(actor.config.lora) if actor.config.lora else None,
            "base_model_path": c.model_path}


def role_arrays(actor, critic=None) -> dict[str, Any]:
    """The checkpointable array trees of the roles by item name. Frozen parameters too (the export tool reads
    them here), except the base weights of a LoRA run: those are the base model's, read again from its
    directory."""
    arrays = {"actor_params": actor.params if actor.config.lora else actor.state(), "actor_opt": actor.opt_state}
    if critic is not None:
        arrays.update(critic_params=critic.params, critic_opt=critic.opt_state)
    return arrays


def restore_roles(arrays: dict[str, Any], actor, critic=None) -> None:
    """Put restored role arrays back into the roles (items a checkpoint lacks keep their current values)."""
    if "actor_params" in arrays:
        actor.load_trained(arrays["actor_params"])
    actor.opt_state = arrays.get("actor_opt", actor.opt_state)
    if critic is not None:
        critic.params = arrays.get("critic_params", critic.params)
        critic.opt_state = arrays.get("critic_opt", critic.opt_state)


def policy_items(actor, cfg, c, loader) -> CheckpointItems:
    """What a policy-only trainer's (SFT, DPO) checkpoint holds: the policy's arrays and the data position."""
    return CheckpointItems(role_arrays(actor), model_record(actor, cfg, c), {"data_state": loader.get_state()},
                           required=("data_state",))


def restore_policy(arrays: dict[str, Any], state: dict | None, actor, loader) -> None:
    """Take back a policy-only checkpoint (``state`` None: the weights only, the data position stays)."""
    restore_roles(arrays, actor)
    if state is not None:
        loader.set_state(state["data_state"])


def export_policy(actor, out_dir: str, step: int, tokenizer, model_path: str) -> str:
    """The actor as a plain HF directory ``<out_dir>/hf/global_step_<step>`` (adapters merged); with LoRA also the
    adapter alone in PEFT's layout (``<dir>/lora_adapter``)."""
    out = os.path.join(out_dir, "hf", f"global_step_{step}")
    model = actor.model()
    save_pretrained(lora.merged_model(model), out, tokenizer=tokenizer, copy_from=model_path)
    if actor.config.lora:
        save_adapter(model, os.path.join(out, ADAPTER_DIR), base_model=model_path)
    return out


class CheckpointService:
    """Saves and restores a trainer's checkpoint items in ``directory``."""

    def __init__(self, directory: str, max_to_keep: int | None, actor_save: tuple, actor_load: tuple,
                 critic_save: tuple | None, critic_load: tuple | None, *, steps_per_epoch: int, seed: int,
                 is_main: bool):
        """``critic_*``: the critic's contents (None: no separate critic in this run)."""
        self.checkpointer = Checkpointer(directory, max_to_keep=max_to_keep)
        self.directory = self.checkpointer.directory
        self.save_contents, self.load_contents = (actor_save, critic_save), (actor_load, critic_load)
        self.steps_per_epoch, self.seed, self.is_main = steps_per_epoch, seed, is_main

    def check(self) -> None:
        self.checkpointer.check()

    def complete_steps(self) -> list[int]:
        return self.checkpointer.complete_steps()

    def close(self) -> None:
        self.checkpointer.close()

    def save(self, step: int, items: CheckpointItems) -> None:
        arrays = {item: items.arrays[item] for item in ckpt_contents.array_items(*self.save_contents)}
        record = {"step": step, "epoch": step // max(self.steps_per_epoch, 1), "seed": self.seed, "model": items.model}
        if "extra" in self.save_contents[0]:
            record.update(items.state)
            arrays.update({k: v for k, v in items.state_arrays.items() if v})
        self.checkpointer.save(step, arrays, {**record, "items": sorted(arrays)})

    def resume(self, trainer, mode: str, resume_from_path: str | None, logger) -> int:
        """Restore the checkpoint ``mode`` names into ``trainer``; returns its step (0: none). Under ``auto`` a
        checkpoint that cannot be read (deleted files, damaged data) is moved aside as ``<step>.unreadable`` and
        the previous complete one is used."""
        root, step = resolve_resume(self.directory, mode, resume_from_path)
        own = root == self.directory
        while step is not None:
            ckpt = self.checkpointer if own else Checkpointer(root, async_save=False, read_only=True)
            with quiet_storage_noise() as quiet:
                try:
                    record, restored, with_state = self._read(ckpt, step, trainer)
                    problem = None
                except CheckpointReadError as e:  # any damage, whatever layer of Orbax notices it
                    problem = str(e)
                    quiet.drain()
                except Exception as e:  # noqa: BLE001 - a checkpoint that reads but does not fit this run
                    problem = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            if not sum_over_processes(np.asarray([problem is not None], np.int64))[0]:
                break
            problem = problem or "on another process"
            if not (own and mode == "auto"):
                raise CheckpointError(f"checkpoint {root}/{step} cannot be read: {problem}")
            aside = self.checkpointer.set_aside(step)
            previous = self.checkpointer.latest_step()
            if self.is_main:
                print(f"warning: checkpoint {root}/{step} cannot be read: {problem}; moved to {aside}, "
                      + (f"resuming from step {previous}" if previous is not None else "starting from step 0"),
                      file=sys.stderr, flush=True)
            step = previous
        if step is None:
            return 0
        trainer.restore(restored, record if with_state else None)
        _, lacking = ckpt_contents.items_to_restore(*self.load_contents, ckpt_contents.saved_items(record))
        fresh = lacking + ([] if with_state else ["data position, KL coefficient"])
        logger.text(f"resumed from {root}/{step} (step {int(record['step'])})"
                    + (f"; not restored (load_contents / saved without them): {', '.join(fresh)}" if fresh else ""))
        return int(record["step"])

    def _read(self, ckpt: Checkpointer, step: int, trainer) -> tuple[dict, dict, bool]:
        """(record, arrays, whether the state is restored) of one checkpoint; changes nothing, so a failure leaves
        the trainer as it was."""
        record = ckpt.restore_extra(step)
        items, _ = ckpt_contents.items_to_restore(*self.load_contents, ckpt_contents.saved_items(record))
        wanted = trainer.checkpoint_items(saved=record)
        with_state = ckpt_contents.restores_extra(self.load_contents[0], record, wanted.required)
        templates = {item: wanted.arrays[item] for item in items}
        if with_state:
            templates.update({k: v for k, v in wanted.state_arrays.items() if v})
        return record, ckpt.restore_arrays(step, templates) if templates else {}, with_state
