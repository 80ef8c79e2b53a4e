"""Supervised fine-tuning (``algorithm.type=sft``): cross-entropy on response tokens, verl's ``sft_trainer``.

``SFTTrainer(cfg).fit()`` runs ``trainer.total_training_steps`` steps (or the epochs' worth) of
``data.train_batch_size`` examples each (data: :mod:`rlhf_jax.data.sft`), one optimizer step per batch with
gradients accumulated over micro-batches of ``data.micro_batch_size_per_gpu`` sequences per shard
(loss: :mod:`rlhf_jax.train.sft_steps`). The policy is built as the RL actor is: ``actor_rollout_ref.model``
(path, dtypes, remat, LoRA), ``actor_rollout_ref.actor.optim`` / ``grad_clip`` / ``freeze`` / ``checkpoint``.
Validation (``trainer.test_freq``, ``val_before_train``) reports ``val/loss`` over ``data.val_files`` and, with
``trainer.val_accuracy``, the RL trainer's generation metrics (greedy per ``rollout.val_kwargs``, scored by the
same reward functions). Checkpoints, exact resume (the loader's position is the checkpoint's ``extra``), HF
export, loggers and SIGTERM handling are the RL trainer's. Training packs the examples into rows
(``model.use_remove_padding``, the default; ``data.micro_batch_size_per_gpu`` rows a micro-batch per shard) or
pads them to power-of-two widths of the batch's longest prompt and response (``use_remove_padding=False``;
``data.micro_batch_size_per_gpu`` sequences a micro-batch); validation runs on padded rows.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from rlhf_jax import models
from rlhf_jax.config import finalize, with_dataset_size
from rlhf_jax.models.hub import resolve_model_path
from rlhf_jax.data import dataset_from_config
from rlhf_jax.data.sft import SFTBatch, max_length_of, sft_dataset_from_config, sft_loader
from rlhf_jax.models import lora
from rlhf_jax.rewards import RewardManager, scorer_name
from rlhf_jax.rollout import Sampler
from rlhf_jax.batch import pack_batch
from rlhf_jax.batch.packing import row_length
from rlhf_jax.data.prompts import pad_token_id_of
from rlhf_jax.parallel.hosts import gather_all, sum_over_processes, to_global
from rlhf_jax.runtime.checkpoint import Checkpointer
from rlhf_jax.train.fit_loop import FitLoop
from rlhf_jax.rollout.generation import key_function
from rlhf_jax.runtime.loggers import MetricLogger
from rlhf_jax.runtime.preemption import STOP, StepAbandoned, StopRequest
from rlhf_jax.runtime.profiling import StepProfiler
from rlhf_jax.train.setup import actor_role, load_tokenizer, mesh_and_rules, sampling_params, tool_schemas
from rlhf_jax.train.trainer import Trainer
from rlhf_jax.train.trainer_checkpoints import CheckpointMixin

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SFTComponents:
    cfg: ConfigDict
    model_path: str
    tokenizer_path: str
    tokenizer: Any
    train: Any  # SFTDataset
    val: Any  # SFTDataset or None
    val_dataset: Any  # the validation prompts (PromptDataset) for generation, or None
    val_sampling: Any
    mesh: Any
    rules: tuple
    rollout_mesh: Any = None  # SFT samples on the training mesh


def _wants_accuracy(cfg: ConfigDict, tokenizer) -> Any:
    """The validation prompts for generation, or None (trainer.val_accuracy; None = when each validation data
    source has a built-in scorer)."""
    setting, data = cfg.trainer.val_accuracy, cfg.data
    if setting is False or not data.val_files:
        return None
    if data.multiturn.enable:
        if setting:
            raise ValueError("trainer.val_accuracy=True: generation validation takes prompt/ground-truth rows; "
                             "with data.multiturn.enable the validation rows are conversations (set it to False)")
        return None
    prompts = dataset_from_config(data, tokenizer, "val")
    if setting is None and any(scorer_name(e.data_source) is None for e in prompts.examples):
        return None
    return prompts


def prepare_sft(cfg: ConfigDict) -> SFTComponents:
    """Paths, tokenizer, SFT data (every row checked before a model loads), the finalized config and the mesh."""
    cfg = ConfigDict(cfg.to_dict()) if cfg.is_locked else cfg
    cfg.unlock()
    model_path = resolve_model_path(cfg.actor_rollout_ref.model.path, cfg.actor_rollout_ref.model.revision)
    checked = finalize(cfg, num_devices=jax.device_count(), num_processes=jax.process_count())  # once, before data
    context = int(models.load_hf_config(model_path).get("max_position_embeddings") or 0)
    if context and max_length_of(checked.data) > context:
        raise ValueError(f"data.max_length={max_length_of(checked.data)} exceeds the model's context of {context} "
                         "positions (max_position_embeddings); lower it")
    tokenizer_path = resolve_model_path(cfg.data.tokenizer) if cfg.data.tokenizer else model_path
    tokenizer = load_tokenizer(tokenizer_path, cfg.data.chat_template)
    tools = tool_schemas(checked)  # the multi-turn rollout's tools, rendered into SFT conversations alike
    train = sft_dataset_from_config(checked.data, tokenizer, "train", tools)
    val = sft_dataset_from_config(checked.data, tokenizer, "val", tools) if checked.data.val_files else None
    cfg = with_dataset_size(checked, len(train))
    val_prompts = _wants_accuracy(cfg, tokenizer)
    mesh, rules = mesh_and_rules(cfg)
    if cfg.mesh.rollout_devices:
        raise ValueError("mesh.rollout_devices: SFT samples only for validation, on the training mesh; set it to 0")
    return SFTComponents(cfg, model_path, tokenizer_path, tokenizer, train, val, val_prompts,
                         sampling_params(cfg, model_path, tokenizer, validation=True), mesh, rules)


def micro_batches(cfg: ConfigDict) -> int:
    """Micro-batches per step from data.train_batch_size, the data-parallel size and data.micro_batch_size_per_gpu."""
    batch, dp, micro = int(cfg.data.train_batch_size), int(cfg.derived.dp_size), int(cfg.data.micro_batch_size_per_gpu)
    if batch % dp:
        raise ValueError(f"data.train_batch_size={batch} must be a multiple of the {dp} data-parallel shards")
    per_shard = batch // dp
    if micro == -1:
        return 1
    if micro <= 0 or per_shard % micro:
        raise ValueError(f"data.micro_batch_size_per_gpu={micro} must divide the {per_shard} sequences each shard "
                         f"holds (data.train_batch_size={batch} over {dp} shards), or be -1")
    return per_shard // micro


class SFTTrainer(FitLoop, CheckpointMixin):
    # Generation validation is the RL trainer's own (same prompts, sampler, scorers, metric names and dumps).
    validate_generations = Trainer.validate
    _generate, _rollout_weights, _sampler_params = Trainer._generate, Trainer._rollout_weights, Trainer._sampler_params
    _rollout_key, _score, _sample = Trainer._rollout_key, Trainer._score, Trainer._sample

    def __init__(self, cfg: ConfigDict, components: SFTComponents | None = None, stop: StopRequest = STOP,
                 lock_dir: bool = False):
        self.stop = stop
        c = components or prepare_sft(cfg)
        self.c, self.cfg, self.mesh, self.tok = c, c.cfg, c.mesh, c.tokenizer
        cfg, d = self.cfg, self.cfg.derived
        self.total_steps = int(d.total_training_steps)
        self.n_micro = micro_batches(cfg)
        # Packed rows (model.use_remove_padding, the default): no FLOPs on padding; exact (same loss and gradient).
        self.packed = bool(cfg.actor_rollout_ref.model.use_remove_padding)
        self.row_len = row_length(max_length_of(cfg.data))
        self._open_output(lock_dir)
        self.actor = actor_role(cfg, c, self.total_steps, 1)
        self.lora = self.actor.config.lora
        self.critic = None
        self.kl_ctrl = {"value": 0.0}  # the checkpoint's extra record holds RL's KL coefficient; SFT has none
        self.loader = sft_loader(cfg.data, self.tok, c.train, "train", num_epochs=None)
        self.checkpointer = Checkpointer(os.path.join(self.out_dir, "checkpoints"),
                                         max_to_keep=cfg.trainer.max_actor_ckpt_to_keep)
        self.logger = MetricLogger(self.log_dir, cfg.trainer.logger, total_steps=self.total_steps, enabled=self.is_main,
                                   run=(cfg.trainer.project_name, cfg.trainer.experiment_name, cfg.to_dict()))
        self.profiler = StepProfiler(cfg.trainer.profile_steps, cfg.trainer.profile_dir)
        self.step = 0
        # What the borrowed generation validation reads.
        self.rollout_mesh, self._rollout_params_of, self._merge_fn, self.reward_model = None, None, None, None
        self.sampler = self.reward_manager = self.multi_turn = None  # single-turn greedy answers only
        if c.val_dataset is not None:
            self._key_fn = key_function(self.mesh)
            graphdef = lora.plain_graphdef(self.actor.config, self.actor.task) if self.lora else self.actor.graphdef
            self.sampler = Sampler(graphdef, mesh=self.mesh, rules=c.rules,
                                   max_positions=self.actor.config.max_position_embeddings)
            self.reward_manager = RewardManager.from_config(cfg.reward_model, cfg.custom_reward_function)

    # The checkpoint mixin also saves the RL loop's sampled-but-untrained batches; an SFT run has none.
    _pending: list = []

    def _pending_for_checkpoint(self) -> tuple[dict, list, Any]:
        return {}, [], self.loader.get_state()

    def _restore_pending(self, arrays: dict, described: list) -> None:
        del arrays, described

    def plan_memory(self) -> None:
        """SFT compiles its step on first use; the micro-batch size is data.micro_batch_size_per_gpu (no plan)."""
        if getattr(self, "_planned", False):
            return
        self._planned = True
        per_shard = int(self.cfg.data.train_batch_size) // int(self.cfg.derived.dp_size)
        micro = int(self.cfg.data.micro_batch_size_per_gpu)
        if self.packed:
            self.logger.text(f"sft: packed rows of {self.row_len} tokens, "
                             + (f"{micro} rows" if micro > 0 else "all rows") + " a micro-batch per shard")
        else:
            self.logger.text(f"sft: {self.n_micro} micro-batch(es) of {per_shard // self.n_micro} sequences per shard")

    # ------------------------------------------------------------------ batches
    def _device_batch(self, b: SFTBatch) -> dict:
        """The model's inputs of a process-local batch, as global arrays on the mesh."""
        put = lambda x: to_global(self.mesh, x)  # noqa: E731
        return {"input_ids": put(np.concatenate([b.prompts, b.responses], 1)),
                "attention_mask": put(np.concatenate([b.prompt_mask, b.response_mask], 1)),
                "responses": put(b.responses), "loss_mask": put(b.loss_mask)}

    def _packed_update(self, b: SFTBatch) -> dict:
        """One step on packed rows (batch/packing.py): the batch's sequences laid end to end in rows of
        ``self.row_len`` tokens, ``data.micro_batch_size_per_gpu`` rows a micro-batch per shard (-1: as few
        micro-batches as the batch allows)."""
        fields = ("prompts", "prompt_mask", "responses", "response_mask")
        host = {k: gather_all(to_global(self.mesh, getattr(b, k))) for k in fields}
        dp = int(self.cfg.derived.dp_size)
        micro = int(self.cfg.data.micro_batch_size_per_gpu)
        packed = pack_batch(host["prompts"], host["prompt_mask"], host["responses"], host["response_mask"], dp=dp,
                            row_len=self.row_len, max_rows_per_micro=micro if micro > 0 else host["prompts"].shape[0],
                            pad_token_id=pad_token_id_of(self.tok))

        def local(x: np.ndarray) -> np.ndarray:  # this process's shards: a contiguous block of every array
            n = x.shape[0] // jax.process_count()
            return x[jax.process_index() * n:(jax.process_index() + 1) * n]

        micros = [{k: to_global(self.mesh, local(v)) for k, v in packed.micro(i).items()}
                  for i in range(packed.num_micro)]
        metrics = self.actor.update_packed(None, micros, {"loss_mask": to_global(self.mesh, b.loss_mask)}, dp=dp,
                                           loss="sft")
        metrics["train/grad_norm"] = metrics.pop("actor/grad_norm")
        metrics["train/loss_tokens"] = jnp.sum(jnp.asarray(sum_over_processes(np.asarray([b.loss_mask.sum()]))))
        return metrics | {"perf/packed_tokens": float(packed.padded_tokens)}

    def train_step(self, b: SFTBatch) -> dict[str, float]:
        start = time.perf_counter()
        if self.packed:
            metrics = self._packed_update(b)
        else:
            metrics = self.actor.update_sft(self._device_batch(b), n_micro=self.n_micro)
        metrics = {k: float(v) for k, v in jax.block_until_ready(metrics).items()}
        seconds = time.perf_counter() - start
        tokens = float(sum_over_processes(np.asarray([b.prompt_mask.sum() + b.response_mask.sum()], np.float64))[0])
        return metrics | {"train/lr": float(self.actor.lr_fn(self.step)), "timing_s/step": seconds,
                          "perf/total_num_tokens": tokens, "perf/throughput": tokens / seconds / self.mesh.devices.size,
                          "training/global_step": self.step + 1, "training/epoch": b.epoch}

    # ------------------------------------------------------------------ validation
    def validation_loss(self) -> dict[str, float]:
        """val/loss: the token mean of the trained tokens' negative log-likelihood over the validation set."""
        if self.c.val is None:
            return {}
        dp_local = max(int(self.cfg.derived.dp_size) // jax.process_count(), 1)
        micro = int(self.cfg.data.micro_batch_size_per_gpu)
        loader = sft_loader(self.cfg.data, self.tok, self.c.val, "val", row_multiple=dp_local * max(micro, 1))
        totals = np.zeros(2)
        for b in loader:
            if self.stop.agreed():
                return {}
            batch = self._device_batch(b)
            per_shard = b.prompts.shape[0] // dp_local
            n_micro = per_shard // micro if micro > 0 else 1
            logp = self.actor.log_probs(batch, n_micro=n_micro, temperature=1.0)
            mask = batch["loss_mask"].astype(jnp.float32)
            totals += [float(-jnp.sum(logp * mask)), float(jnp.sum(mask))]  # global arrays: sums over every process
        return {"val/loss": totals[0] / max(totals[1], 1.0)}

    def validate(self) -> dict[str, float]:
        metrics = self.validation_loss()
        if self.c.val_dataset is not None and not self.stop.agreed():
            metrics.update(self.validate_generations())
        return metrics

    # ------------------------------------------------------------------ the loop (FitLoop)
    def _next_step(self) -> dict[str, Any]:
        data_state = self.loader.get_state()
        batch = next(self.loader)
        if self.stop.agreed():  # the last point before the step changes the weights
            self.loader.set_state(data_state)
            raise StepAbandoned
        return self.train_step(batch)

    def _close_resources(self) -> None:
        if self.reward_manager is not None:
            self.reward_manager.close()
