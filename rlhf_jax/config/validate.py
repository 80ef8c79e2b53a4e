"""Finalize a config once per run: fill every default, check every rule, derive the sizes, before anything compiles.

:func:`finalize` is a pure function of the config, the device and process counts and (optionally) the training-set
size; it reads nothing but the model's ``config.json`` and the existence of the files the config names. In order:

1. ``${...}`` references resolved; the rules of :data:`rlhf_jax.config.rule.GIVEN_RULES` judge what was written;
2. every ``None`` default filled (:mod:`rlhf_jax.config.defaults`: ``same_as`` keys and computed ones);
3. each key's own rule (``choices``, ``check=`` in the key table), then the cross-key rules of
   :mod:`rlhf_jax.config.rules` and :mod:`rlhf_jax.config.rules_run`, in order;
4. the ``derived`` section (:mod:`rlhf_jax.config.derive`: devices, mesh, batch splits, steps, the model's limits).

It returns a locked copy that consumers read as it is: they never default again. A training set's size known only
after the data is read is added by :func:`with_dataset_size` (the steps and warmups; nothing is checked twice).
Every error is a ValueError of one line naming the key and the fix.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

from ml_collections import ConfigDict

from rlhf_jax.config import builtin, placement, rules, rules_run, schema  # noqa: F401  (rules register themselves)
from rlhf_jax.config.defaults import fill_defaults
from rlhf_jax.config.derive import derive_batches, derive_steps
from rlhf_jax.config.interpolation import has_reference, resolve
from rlhf_jax.config.rule import GIVEN_RULES, RULES, Context, run_rules

log = logging.getLogger("rlhf_jax.config")


def _resolve_references(cfg: ConfigDict) -> None:
    def lookup(path: str) -> Any:
        if path not in schema.DOCS:
            raise KeyError(path)
        return schema.get_path(cfg, path)

    for path, value in list(schema.iter_leaves(cfg)):
        if has_reference(value):
            schema.set_path(cfg, path, resolve(value, lookup, path))


def check_keys(cfg: ConfigDict) -> None:
    """Each key's own rule (its ``choices`` and ``check``), in key-table order."""
    for key in schema.KEYS:
        if key.check_if is not None and not schema.get_path(cfg, key.check_if):
            continue
        problem = key.failure(schema.get_path(cfg, key.path))
        if problem is not None:
            raise ValueError(problem)


def resolve_mesh(data: int, fsdp: int, tensor: int, num_devices: int, expert: int = 1,
                 context: int = 1) -> tuple[int, int, int, int, int]:
    """(data, fsdp, tensor, expert, context) sizes with the one -1 (if any) filled so that they multiply to
    ``num_devices``."""
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor, "expert": expert, "context": context}
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{name}={size} must be a positive size or -1 (the rest)")
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"only one mesh axis may be -1; got {', '.join('mesh.' + f for f in free)} = -1")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(f"mesh.{free[0]}=-1: {num_devices} devices are not divisible by the other axes' "
                             f"product {fixed}; change mesh.data/fsdp/tensor/expert/context")
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(f"mesh.data x mesh.fsdp x mesh.tensor x mesh.expert x mesh.context = {data} x {fsdp} x "
                         f"{tensor} x {expert} x {context} = {fixed}, but there are "
                         f"{num_devices} devices; make them multiply to {num_devices} or set one axis to -1")
    return sizes["data"], sizes["fsdp"], sizes["tensor"], sizes["expert"], sizes["context"]


def _check_model_limits(cfg: ConfigDict, derived: ConfigDict) -> None:
    hf = builtin.model_hf_config(cfg.actor_rollout_ref.model.path, cfg.actor_rollout_ref.model.revision) or {}
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    max_pos = hf.get("max_position_embeddings", text.get("max_position_embeddings"))
    derived.model_max_position_embeddings = int(max_pos) if max_pos else -1
    vocab = hf.get("vocab_size", text.get("vocab_size"))
    derived.model_vocab_size = int(vocab) if vocab else -1
    total = cfg.data.max_prompt_length + cfg.actor_rollout_ref.rollout.response_length
    if max_pos and total > max_pos:
        raise ValueError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + actor_rollout_ref.rollout.response_length "
            f"({cfg.actor_rollout_ref.rollout.response_length}) = {total} exceeds the model's "
            f"max_position_embeddings ({max_pos}); shorten them so they sum to at most {max_pos}")


def finalize(
    cfg: ConfigDict,
    *,
    num_devices: int,
    num_processes: int = 1,
    train_dataset_size: int | None = None,
    check_paths: bool = True,
) -> ConfigDict:
    """A locked, checked copy of ``cfg`` with every default filled and a ``derived`` section added.

    ``train_dataset_size`` (prompts, after filtering) lets the total step count be derived from
    ``trainer.total_epochs``; without it, only an explicit ``trainer.total_training_steps`` fixes it
    (``derived.total_training_steps`` is -1 until :func:`with_dataset_size`). ``check_paths=False`` skips
    file-existence checks (to check a recipe meant for another machine).
    """
    if num_devices < 1 or num_processes < 1 or num_devices % num_processes:
        raise ValueError(f"num_devices={num_devices} must be a positive multiple of num_processes={num_processes}")
    schema.check_known_keys(cfg)
    out = copy.deepcopy(cfg)
    out.unlock()
    if "derived" in out:
        del out["derived"]
    ctx = Context(num_devices=num_devices, num_processes=num_processes, check_paths=check_paths)
    _resolve_references(out)
    run_rules(out, ctx, GIVEN_RULES)
    fill_defaults(out)
    check_keys(out)
    run_rules(out, ctx, RULES)
    train_devices = placement.train_devices(out, placement.used_devices(out, num_devices, num_processes),
                                            num_processes)
    # mesh.context=0 (automatic) is resolved by main and the plan command before this (plan/context.py); anything
    # else that finalizes such a config runs its passes unsplit
    mesh = resolve_mesh(out.mesh.data, out.mesh.fsdp, out.mesh.tensor, train_devices, out.mesh.expert,
                        out.mesh.context or 1)
    derived = derive_batches(out, mesh=mesh, num_devices=train_devices, num_processes=num_processes,
                             train_dataset_size=train_dataset_size)
    _check_model_limits(out, derived)
    if out.actor_rollout_ref.actor.use_kl_loss and out.algorithm.use_kl_in_reward:
        log.warning("both actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward are on: the KL "
                    "to the reference is penalised twice")
    dl = out.distillation.distillation_loss
    if out.distillation.enabled and dl.loss_mode == "forward_kl_topk" and dl.use_policy_gradient:
        log.warning("distillation.distillation_loss.loss_mode=forward_kl_topk with use_policy_gradient=true: the "
                    "update moves only the sampled token's log-prob; the top-k distribution's signal is mostly unused")
    out.derived = derived
    out.lock()
    return out


def with_dataset_size(cfg: ConfigDict, train_dataset_size: int) -> ConfigDict:
    """A finalized ``cfg`` with the steps that depend on the training set's size derived (epochs, warmups)."""
    out = copy.deepcopy(cfg)
    out.unlock()
    derive_steps(out.derived, out, train_dataset_size)
    out.lock()
    return out
