"""Supervised fine-tuning (``algorithm.type=sft``): cross-entropy on response tokens, verl's ``sft_trainer``.

``SFTTrainer(cfg).fit()`` runs ``trainer.total_training_steps`` steps (or the epochs' worth) of
``data.train_batch_size`` examples each (data: :mod:`rlhf_jax.data.sft`), one optimizer step per batch with
gradients accumulated over micro-batches of ``data.micro_batch_size_per_gpu`` sequences per shard
(loss: :mod:`rlhf_jax.train.sft_steps`). The policy is built as the RL actor is: ``actor_rollout_ref.model``
(path, dtypes, remat, LoRA), ``actor_rollout_ref.actor.optim`` / ``grad_clip`` / ``freeze`` / ``checkpoint``.
Validation (``trainer.test_freq``, ``val_before_train``) reports ``val/loss`` over ``data.val_files`` and, with
``trainer.val_accuracy``, the RL trainer's generation metrics (greedy per ``rollout.val_kwargs``, scored by the
same reward functions: train/validation.py, shared with the RL trainer). Checkpoints, exact resume (the loader's
position is the checkpoint's ``extra``), HF export, loggers and SIGTERM handling are the run loop's
(train/fit_loop.py), as for every trainer. Training packs the examples into rows
(``model.use_remove_padding``, the default; ``data.micro_batch_size_per_gpu`` rows a micro-batch per shard) or
pads them to power-of-two widths of the batch's longest prompt and response (``use_remove_padding=False``;
``data.micro_batch_size_per_gpu`` sequences a micro-batch); validation runs on padded rows.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from rlhf_jax.parallel import groups
from rlhf_jax import models
from rlhf_jax.config import finalize, with_dataset_size
from rlhf_jax.models.hub import resolve_model_path
from rlhf_jax.data import dataset_from_config, loader_from_config
from rlhf_jax.data.prompts import pad_token_id_of, resolve_buckets
from rlhf_jax.data.sft import SFTBatch, max_length_of, sft_dataset_from_config, sft_loader
from rlhf_jax.batch.packing import row_length
from rlhf_jax.models import lora
from rlhf_jax.rewards import RewardManager, scorer_name
from rlhf_jax.rollout import Sampler
from rlhf_jax.train import losses
from rlhf_jax.parallel.hosts import gather_all, sum_over_processes, to_global
from rlhf_jax.train.fit_loop import RunLoop
from rlhf_jax.train.layout import Packer, layout
from rlhf_jax.train.passes import PassPlan
from rlhf_jax.runtime.preemption import STOP, StepAbandoned, StopRequest
from rlhf_jax.train.setup import actor_role, load_tokenizer, mesh_and_rules, sampling_params, tool_schemas
from rlhf_jax.train.trainer_checkpoints import CheckpointItems, export_policy, policy_items, restore_policy
from rlhf_jax.train.trainer_rollout import Rollouts
from rlhf_jax.train.validation import Validator
from rlhf_jax.types import TrainBatch

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


def check_context(cfg: ConfigDict, hf: dict) -> None:
    """Stop when data.max_length exceeds the context of the model whose config.json is ``hf``."""
    context = int(hf.get("max_position_embeddings") or 0)
    if context and max_length_of(cfg.data) > context:
        raise ValueError(f"data.max_length={max_length_of(cfg.data)} exceeds the model's context of {context} "
                         "positions (max_position_embeddings); lower it")


def prepare_sft(cfg: ConfigDict) -> SFTComponents:
    """Paths, tokenizer, SFT data (every row checked before a model loads), the finalized config and the mesh."""
    cfg = ConfigDict(cfg.to_dict()) if cfg.is_locked else cfg
    cfg.unlock()
    model_path = resolve_model_path(cfg.actor_rollout_ref.model.path, cfg.actor_rollout_ref.model.revision)
    checked = finalize(cfg, num_devices=groups.device_count(), num_processes=groups.process_count())  # once, before data
    check_context(checked, models.load_hf_config(model_path))
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


def sft_pass_plan(cfg: ConfigDict) -> PassPlan:
    """The update's layout. Packed rows (model.use_remove_padding, the default): no FLOPs on padding; exact (same
    loss and gradient). ``data.micro_batch_size_per_gpu`` rows (packed) or sequences (padded) a micro-batch per
    shard; -1: as few micro-batches as the batch allows."""
    batch, dp = int(cfg.data.train_batch_size), int(cfg.derived.dp_size)
    micro = int(cfg.data.micro_batch_size_per_gpu)
    per_shard, n_micro = batch // dp, micro_batches(cfg)
    packed = bool(cfg.actor_rollout_ref.model.use_remove_padding)
    rows = (micro if micro > 0 else batch) if packed else per_shard // n_micro
    return PassPlan("sft", packed, row_length(max_length_of(cfg.data)), rows, per_shard,
                    ("data.micro_batch_size_per_gpu",), auto=micro == -1)


def widest_batch(cfg: ConfigDict) -> tuple[int, int]:
    """(prompt, response) columns of the widest batch the loader can give (``SFTLoader``: each side bucketed on its
    own): the buckets of a prompt and a response that together fit data.max_length with the most columns, then the
    most response columns (the vocabulary projection's)."""
    length = max_length_of(cfg.data)
    buckets = resolve_buckets(length, None)
    least = {b: (buckets[i - 1] + 1 if i else 1) for i, b in enumerate(buckets)}  # the shortest side needing b
    pairs = [(p, r) for p in buckets for r in buckets if least[p] + least[r] <= length]
    return max(pairs, key=lambda pr: (pr[0] + pr[1], pr[1]))


def _local_shards(cfg: ConfigDict, processes: int) -> int:
    return max(int(cfg.derived.dp_size) // processes, 1)


def validation_rows(cfg: ConfigDict, processes: int) -> int:
    """Each process pads a validation batch to a multiple of this many rows (its shards times the micro-batch)."""
    return _local_shards(cfg, processes) * max(int(cfg.data.micro_batch_size_per_gpu), 1)


def validation_micro_batches(cfg: ConfigDict, local_rows: int, processes: int) -> int:
    """Micro-batches of the validation pass over a batch of ``local_rows`` rows on each process."""
    micro = int(cfg.data.micro_batch_size_per_gpu)
    return local_rows // _local_shards(cfg, processes) // micro if micro > 0 else 1


class SFTTrainer:
    """The SFT trainer (the ``fit_loop.Trainer`` protocol)."""

    def __init__(self, cfg: ConfigDict, components: SFTComponents | None = None, stop: StopRequest = STOP,
                 lock_dir: bool = False):
        c = components or prepare_sft(cfg)
        self.c, self.cfg, self.stop = c, c.cfg, stop
        cfg, d = self.cfg, self.cfg.derived
        ckpt = cfg.actor_rollout_ref.actor.checkpoint
        self.loop = RunLoop(cfg, stop, lock_dir, max_to_keep=cfg.trainer.max_actor_ckpt_to_keep,
                            checkpoint_contents=(tuple(ckpt.save_contents), tuple(ckpt.load_contents), None, None))
        self.actor = actor_role(cfg, c, self.loop.total_steps, 1)
        self.loader = sft_loader(cfg.data, c.tokenizer, c.train, "train", num_epochs=None)
        self.plan = sft_pass_plan(cfg)
        self.rollouts = self.validator = None
        if c.val_dataset is not None:  # single-turn greedy answers, scored by the run's reward functions
            spec = self.actor.config.lora
            graphdef = lora.plain_graphdef(self.actor.config, self.actor.task) if spec else self.actor.graphdef
            sampler = Sampler(graphdef, mesh=c.mesh, rules=c.rules,
                              max_positions=self.actor.config.max_position_embeddings)
            self.rollouts = Rollouts(self.actor, sampler, c.tokenizer,
                                     RewardManager.from_config(cfg.reward_model, cfg.custom_reward_function),
                                     mesh=c.mesh, rules=c.rules, dp_size=d.dp_size,
                                     weight_dtype=cfg.actor_rollout_ref.rollout.weight_dtype,
                                     compute_dtype=self.actor.config.dtype)
            self.validator = Validator(
                self.rollouts, lambda: loader_from_config(cfg.data, c.tokenizer, "val", dataset=c.val_dataset),
                c.val_dataset, c.val_sampling, stop, self.loop.logger, cfg.trainer.log_val_generations,
                cfg.trainer.validation_data_dir, self.loop.is_main)
        self._planned = False

    def plan_memory(self) -> tuple[str, ...]:
        """SFT compiles its step on first use; the micro-batch size is data.micro_batch_size_per_gpu (no plan)."""
        if not self._planned:
            self._planned = True
            plan, micro = self.plan, int(self.cfg.data.micro_batch_size_per_gpu)
            if plan.packed:
                self.loop.logger.text(f"sft: packed rows of {plan.row_len} tokens, "
                                      + (f"{micro} rows" if micro > 0 else "all rows") + " a micro-batch per shard")
            else:
                self.loop.logger.text(f"sft: {plan.num_micro} micro-batch(es) of {plan.rows_per_micro} sequences "
                                      "per shard")
        return ()

    # ------------------------------------------------------------------ one step
    def _device_batch(self, b: SFTBatch) -> TrainBatch:
        """The model's inputs of a process-local batch, as global arrays on the mesh; the trained tokens are the
        response mask."""
        put = lambda x: to_global(self.c.mesh, x)  # noqa: E731
        return TrainBatch(input_ids=put(np.concatenate([b.prompts, b.responses], 1)),
                          attention_mask=put(np.concatenate([b.prompt_mask, b.response_mask], 1)),
                          responses=put(b.responses), response_mask=put(b.loss_mask))

    def step(self, step: int) -> dict[str, Any]:
        """One optimizer step on the next batch of examples."""
        data_state = self.loader.get_state()
        b = next(self.loader)
        if self.stop.agreed():  # the last point before the step changes the weights
            self.loader.set_state(data_state)
            raise StepAbandoned
        self.plan_memory()
        start = time.perf_counter()
        fields = ("prompts", "prompt_mask", "responses", "response_mask")
        packer = Packer(self.c.mesh, int(self.cfg.derived.dp_size), pad_token_id_of(self.c.tokenizer), lambda: {
            "response_valid" if k == "response_mask" else k: gather_all(to_global(self.c.mesh, getattr(b, k)))
            for k in fields})
        run = layout(self.plan, packer)
        metrics = run.update(self.actor, losses.SFT, run.carried(self._device_batch(b)))
        if "train/loss_tokens" not in metrics:  # a packed update counts its trained tokens per micro-batch
            metrics["train/loss_tokens"] = jnp.sum(jnp.asarray(sum_over_processes(np.asarray([b.loss_mask.sum()]))))
        metrics.update({"perf/packed_tokens": cells for cells, _ in packer.tokens.values()})  # packed rows' cells
        metrics = {k: float(v) for k, v in jax.block_until_ready(metrics).items()}
        seconds = time.perf_counter() - start
        tokens = float(sum_over_processes(np.asarray([b.prompt_mask.sum() + b.response_mask.sum()], np.float64))[0])
        return metrics | {"train/lr": float(self.actor.lr_fn(step)), "timing_s/step": seconds,
                          "perf/total_num_tokens": tokens,
                          "perf/throughput": tokens / seconds / self.c.mesh.devices.size,
                          "training/global_step": step + 1, "training/epoch": b.epoch}

    # ------------------------------------------------------------------ validation
    def validation_loss(self) -> dict[str, float]:
        """val/loss: the token mean of the trained tokens' negative log-likelihood over the validation set."""
        if self.c.val is None:
            return {}
        processes = groups.process_count()
        loader = sft_loader(self.cfg.data, self.c.tokenizer, self.c.val, "val",
                            row_multiple=validation_rows(self.cfg, processes))
        totals = np.zeros(2)
        for b in loader:
            if self.stop.agreed():
                return {}
            batch = self._device_batch(b)
            n_micro = validation_micro_batches(self.cfg, b.prompts.shape[0], processes)
            logp = self.actor.log_probs(batch, n_micro=n_micro, temperature=1.0)
            mask = batch.response_mask.astype(jnp.float32)
            totals += [float(-jnp.sum(logp * mask)), float(jnp.sum(mask))]  # global arrays: sums over every process
        return {"val/loss": totals[0] / max(totals[1], 1.0)}

    def validate(self, step: int) -> dict[str, float]:
        metrics = self.validation_loss()
        if self.validator is not None and not self.stop.agreed():
            metrics.update(self.validator(step))
        return metrics

    # ------------------------------------------------------------------ checkpoints and the loop's other calls
    def checkpoint_items(self, saved: dict | None = None) -> CheckpointItems:
        return policy_items(self.actor, self.cfg, self.c, self.loader)

    def restore(self, arrays: dict[str, Any], state: dict | None) -> None:
        restore_policy(arrays, state, self.actor, self.loader)

    def export_hf(self, step: int) -> str:
        return export_policy(self.actor, self.loop.out_dir, step, self.c.tokenizer, self.c.model_path)

    def fit(self) -> dict[str, Any]:
        return self.loop.fit(self)

    def out_of_memory(self, error: BaseException) -> str | None:
        return self.loop.out_of_memory(error)

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()
        self.loop.close()
