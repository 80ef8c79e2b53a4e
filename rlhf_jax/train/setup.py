"""Build everything a run needs from a config: tokenizer, data, mesh, models, sampler, rewards.

All checks that can fail on bad input (data files, batch arithmetic, model
limits) run here, before any model is compiled.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from rlhf_jax.parallel import groups
from rlhf_jax import models
from rlhf_jax.config import finalize, names, with_dataset_size
from rlhf_jax.models.hub import resolve_model_path
from rlhf_jax.models.sequence_split import check_heads
from rlhf_jax.parallel import make_mesh
from rlhf_jax.rollout import SamplingParams, eos_token_ids_from_dir

log = logging.getLogger(__name__)

DTYPES = {name: getattr(jnp, name) for name in names.DTYPES}  # the dtype keys' names as jnp types


@dataclasses.dataclass
class Components:
    cfg: ConfigDict
    model_path: str  # a local directory (builtin models built, hub ids resolved)
    tokenizer_path: str  # a local directory
    tokenizer: Any
    train_dataset: Any
    val_dataset: Any
    mesh: Any
    rules: tuple
    sampling: SamplingParams
    val_sampling: SamplingParams
    rollout_mesh: Any = None  # mesh.rollout_devices > 0: the sampler's own mesh


def load_tokenizer(path: str, chat_template: str | None = None):
    """The tokenizer at ``path``; ``chat_template`` (Jinja text, or a path to a .jinja file) replaces its own."""
    import os

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if chat_template:
        template = os.path.expanduser(chat_template)
        if os.path.isfile(template):
            with open(template) as fh:
                template = fh.read()
        elif "{" not in template:
            raise ValueError(f"data.chat_template={chat_template!r} is neither a file nor a Jinja template")
        tok.chat_template = template  # exported with the model, so the trained model keeps its template
    return tok


def tool_schemas(cfg: ConfigDict) -> list[dict] | None:
    """The function schemas of the multi-turn tools of a finalized config (listed in every prompt by the chat template),
    or None."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None
    from rlhf_jax.agents.settings import turn_settings

    return [t.schema() for t in turn_settings(mt, cfg.actor_rollout_ref.rollout.response_length).tools]


def prepare(cfg: ConfigDict) -> Components:
    """Resolve paths, read and tokenize the data, finalize the config, build the mesh and sampling settings."""
    from rlhf_jax.data import dataset_from_config

    cfg = ConfigDict(cfg.to_dict()) if cfg.is_locked else cfg
    cfg.unlock()
    model_path = resolve_model_path(cfg.actor_rollout_ref.model.path, cfg.actor_rollout_ref.model.revision)
    # Every check that needs no data (keys, rules, batch arithmetic, file paths) first, once.
    # the whole run: with mesh.rollout_processes the placement gives the training mesh its processes' devices
    cfg = finalize(cfg, num_devices=jax.device_count(), num_processes=jax.process_count())
    tokenizer_path = resolve_model_path(cfg.data.tokenizer) if cfg.data.tokenizer else model_path
    tokenizer = load_tokenizer(tokenizer_path, cfg.data.chat_template)
    tools = tool_schemas(cfg)
    train_dataset = dataset_from_config(cfg.data, tokenizer, "train", tools)
    val_dataset = dataset_from_config(cfg.data, tokenizer, "val", tools) if cfg.data.val_files else None
    cfg = with_dataset_size(cfg, len(train_dataset))
    _note_fallback_scorer(cfg, train_dataset, val_dataset)
    _check_interaction_rows(cfg, train_dataset, val_dataset)
    mesh, rules = mesh_and_rules(cfg)
    sampling = sampling_params(cfg, model_path, tokenizer)
    val_sampling = sampling_params(cfg, model_path, tokenizer, validation=True)
    return Components(cfg, model_path, tokenizer_path, tokenizer, train_dataset, val_dataset, mesh, rules, sampling, val_sampling,
                      rollout_mesh(cfg))


def run_devices(cfg: ConfigDict) -> list:
    """The devices the run trains on: the first ``trainer.n_gpus_per_node`` of each process (all when None), of the
    training processes when ``mesh.rollout_processes`` gives sampling its own (on every process of the run)."""
    n = cfg.trainer.n_gpus_per_node
    group = groups.current() if not cfg.mesh.rollout_processes else \
        groups.split(jax.process_count(), cfg.mesh.rollout_processes)[0]
    devices = group.devices() if not group.spans_the_run() else jax.devices()
    if n is None:
        return devices
    return [d for p in group.processes for d in [d for d in devices if d.process_index == p][:n]]


def rollout_mesh(cfg: ConfigDict):
    """With ``mesh.rollout_devices`` = k > 0: a data-parallel mesh over the last k devices of the run; with
    ``mesh.rollout_processes`` = k > 0, over the devices of the last k processes (the sampling group's); else
    None."""
    if cfg.mesh.rollout_processes:
        sampling = groups.split(jax.process_count(), cfg.mesh.rollout_processes)[1]
        n = cfg.trainer.n_gpus_per_node
        devices = [d for p in sampling.processes for d in [d for d in sampling.devices() if d.process_index == p][:n]]
        return make_mesh(data=len(devices), fsdp=1, tensor=1, expert=1, devices=devices)
    k = cfg.mesh.rollout_devices
    return make_mesh(data=k, fsdp=1, tensor=1, expert=1, devices=run_devices(cfg)[-k:]) if k else None


def mesh_and_rules(cfg: ConfigDict) -> tuple[Any, tuple]:
    """The (training) device mesh of a finalized config and its logical-axis rules as tuples."""
    devices = run_devices(cfg)
    mesh = make_mesh(*cfg.derived.mesh_shape, devices=devices[:len(devices) - cfg.mesh.rollout_devices])
    rules = tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
                  for name, axes in cfg.mesh.logical_axis_rules)
    return mesh, rules


def sampling_params(cfg: ConfigDict, model_path: str, tokenizer, *, validation: bool = False) -> SamplingParams:
    """Training (rollout.*) or validation (rollout.val_kwargs.*) sampling settings of a finalized config."""
    params = SamplingParams.from_config(cfg.actor_rollout_ref.rollout, validation=validation,
                                        eos_token_ids=eos_token_ids_from_dir(model_path, tokenizer),
                                        pad_token_id=tokenizer.pad_token_id)
    # R3 routing replay: the training rollouts record the expert ids the passes replay
    record = not validation and cfg.actor_rollout_ref.actor.get("router_replay", {}).get("mode") == "R3"
    return params.replace(record_routes=record) if record else params


def _note_fallback_scorer(cfg: ConfigDict, *datasets) -> None:
    """Say which data sources the built-in scorers do not know, and so are scored by answer matching."""
    from rlhf_jax.rewards import scorer_name

    if cfg.custom_reward_function.path:
        return
    unknown = sorted({e.data_source for ds in datasets if ds is not None for e in ds.examples
                      if scorer_name(e.data_source) is None})
    if unknown and groups.current().is_first:
        log.warning("data_source %s: no built-in scorer, scored by answer_match (reward_model.answer_match=%s)",
                    ", ".join(unknown), cfg.reward_model.answer_match)


def _check_interaction_rows(cfg: ConfigDict, *datasets) -> None:
    """With interactions, every row of the data names one of them."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not (mt.enable and mt.interaction_config_path):
        return
    from rlhf_jax.agents.interactions import check_rows, read_config

    names = [e.name for e in read_config(mt.interaction_config_path)]
    for ds in datasets:
        if ds is not None:
            check_rows(names, ds.examples)


def _check_mesh_axes(cfg: ConfigDict, model_path: str) -> None:
    """mesh.expert must split a Mixture-of-Experts model's experts evenly (otherwise they would be replicated), and
    mesh.context x mesh.tensor the attention heads where mesh.context_attention=ulysses (which splits them over
    both; "auto" gathers keys/values instead where they do not divide)."""
    hf = models.load_hf_config(model_path)
    experts, ways = int(hf.get("num_experts") or hf.get("num_local_experts") or 0), int(cfg.mesh.expert)
    if experts and ways > 1 and experts % ways:
        raise ValueError(f"mesh.expert={ways} does not divide the {experts} experts of {model_path}; "
                         f"choose a divisor of {experts}")
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    heads = int(text.get("num_attention_heads") or 0)
    if heads:
        check_heads(heads, int(cfg.mesh.context), int(cfg.mesh.tensor), cfg.mesh.context_attention)


def load_policy(cfg: ConfigDict, model_path: str, mesh, rules, *, role: str = "actor", task: str | None = None,
                path: str | None = None):
    """The actor, reference or critic (``role``) with its dtypes, attention and remat policy.

    Remat follows the role's ``enable_gradient_checkpointing`` / ``remat_policy``; the reference
    has no backward pass and never rematerializes.
    """
    model_cfg = cfg.actor_rollout_ref.model
    _check_mesh_axes(cfg, path or model_path)
    role_cfg = cfg.critic.model if role == "critic" else model_cfg
    remat = role_cfg.remat_policy if role != "ref" and role_cfg.enable_gradient_checkpointing else "none"
    return models.from_pretrained(
        path or model_path, mesh=mesh, rules=rules, dtype=DTYPES[model_cfg.compute_dtype],
        param_dtype=DTYPES[model_cfg.dtype], remat=remat, attn_impl=model_cfg.attn_implementation,
        context_attention=cfg.mesh.context_attention, task=task,
    )


def sampler_graphdef(cfg: ConfigDict, model_config, task: str, graphdef=None):
    """The graph the sampler runs over the actor's parameters: the actor's own (``graphdef``) computing in
    ``rollout.dtype`` (verl's rollout dtype); parameters keep their dtype and are cast at use, so sampling in
    bfloat16 needs no second copy of the weights. ``graphdef=None`` (LoRA: the sampler runs the plain model on
    merged weights) always builds the plain model's graph."""
    from rlhf_jax.models import lora

    dtype = DTYPES[cfg.actor_rollout_ref.rollout.dtype]
    if graphdef is not None and model_config.dtype == dtype:
        return graphdef
    return lora.plain_graphdef(model_config.replace(dtype=dtype), task)


LORA_KEY = "actor_rollout_ref.model."


def lora_spec(cfg: ConfigDict, model_cfg=None):
    """The actor's ``models.lora.LoraSpec`` (None when ``lora_rank`` is 0); ``target_modules`` means what PEFT makes
    of it on ``model_cfg``'s family (a ``ModelConfig``; None: a dense decoder)."""
    from rlhf_jax.models import lora

    m = cfg.actor_rollout_ref.model
    if not m.lora_rank:
        return None
    return lora.LoraSpec(int(m.lora_rank), float(m.lora_alpha),
                         lora.resolve_targets(m.target_modules, key=LORA_KEY + "target_modules", model_cfg=model_cfg))


def actor_trainable(cfg: ConfigDict, model_path: str):
    """What the actor's updates train, as an ``nnx`` filter (None: everything): the LoRA adapters, or what the
    freeze section leaves. Checked against the model's abstract parameters before any weight is read."""
    from flax import nnx

    from rlhf_jax.models import lora, lora_peft
    from rlhf_jax.models.hf_import import build_abstract
    from rlhf_jax.train import freeze

    freeze_spec = freeze.FreezeSpec.from_config(cfg.actor_rollout_ref.actor.freeze)
    if not cfg.actor_rollout_ref.model.lora_rank and not freeze_spec.active:
        return None
    model_cfg = models.from_hf_dict(models.load_hf_config(model_path))
    spec = lora_spec(cfg, model_cfg)
    if spec is not None:
        if freeze_spec.active:
            raise ValueError(f"{LORA_KEY}lora_rank={spec.rank} trains only the adapters: unset "
                             f"{freeze.KEY}* (the base weights are frozen already)")
        if model_cfg.model_type == "phi3":
            raise ValueError(f"{LORA_KEY}lora_rank: LoRA on Phi-3 (fused qkv_proj / gate_up_proj) is not supported")
        adapter = cfg.actor_rollout_ref.model.lora_adapter_path
        if adapter:
            try:
                found = lora_peft.spec_from_config(lora_peft.read_config(adapter), model_cfg)
            except ValueError as e:
                raise ValueError(f"{LORA_KEY}lora_adapter_path: {e}") from None
            if found != spec:
                raise ValueError(f"{LORA_KEY}lora_adapter_path={adapter!r} has r={found.rank}, lora_alpha={found.alpha:g}, "
                                 f"target_modules={list(found.targets)}; set lora_rank, lora_alpha and target_modules "
                                 "to match it")
        return lora.trained_filter
    _, state = nnx.split(build_abstract(model_cfg, models.TASK_CAUSAL_LM))
    return freeze.check(freeze_spec, state, model_cfg.num_hidden_layers)


def load_actor(cfg: ConfigDict, model_path: str, mesh, rules):
    """The actor model: the checkpoint, with LoRA adapters when ``lora_rank`` > 0 (fresh, or read from
    ``lora_adapter_path``), with a value head on its trunk under ``critic.shared_trunk``."""
    from rlhf_jax.models import TASK_CAUSAL_LM_VALUE, lora, lora_peft

    shared = cfg.critic.enable and cfg.critic.shared_trunk
    model = load_policy(cfg, model_path, mesh, rules, task=TASK_CAUSAL_LM_VALUE if shared else None)
    spec = lora_spec(cfg, model.config)
    if spec is None:
        return model
    model = lora.with_adapters(model, spec, mesh, rules, seed=int(cfg.trainer.seed))
    adapter = cfg.actor_rollout_ref.model.lora_adapter_path
    return lora_peft.load_adapter(model, adapter) if adapter else model


def offload_flags(cfg: ConfigDict, role: str) -> dict[str, bool]:
    """``engine.Role``'s offload arguments of the actor's or the critic's ``fsdp_config.param_offload`` /
    ``optimizer_offload`` (``role``: "actor" or "critic")."""
    fsdp = cfg.critic.model.fsdp_config if role == "critic" else cfg.actor_rollout_ref.actor.fsdp_config
    return {"offload": bool(fsdp.param_offload), "offload_optimizer": bool(fsdp.optimizer_offload)}


def actor_role(cfg: ConfigDict, c: Any, total_steps: int, updates_per_step: int):
    """The trained policy as an ``engine.Role``: its optimizer and schedule, and the freeze / LoRA filter (checked
    before any weight is read)."""
    from rlhf_jax.train.engine import Role
    from rlhf_jax.train.optim import make_optimizer

    actor = cfg.actor_rollout_ref.actor
    tx, lr_fn = make_optimizer(actor.optim, actor.grad_clip, total_steps, updates_per_step)
    trainable = actor_trainable(cfg, c.model_path)
    return Role(load_actor(cfg, c.model_path, c.mesh, c.rules), c.mesh, tx, lr_fn, trainable,
                **offload_flags(cfg, "actor"))


def reference_role(cfg: ConfigDict, c: Any, actor):
    """The frozen reference policy. Without LoRA it is its own copy (the actor's arrays are donated and replaced by
    every update); with LoRA it is the base model with the adapters off over the actor's frozen arrays: no copy (in
    host memory when the actor offloads them)."""
    from flax import nnx

    from rlhf_jax.train.engine import Role

    offload = bool(cfg.actor_rollout_ref.ref.fsdp_config.param_offload)
    if cfg.distillation.enabled:  # the teacher takes the reference's place
        return Role(teacher_model(cfg, c, actor), c.mesh, offload=offload)
    if actor.config.lora:  # the causal LM: a value head on the actor's trunk trains, so it is not in ``frozen``
        return Role(nnx.merge(models.lora.plain_graphdef(actor.config, models.TASK_CAUSAL_LM), actor.frozen), c.mesh)
    return Role(load_policy(cfg, c.model_path, c.mesh, c.rules, role="ref"), c.mesh, offload=offload)


def teacher_model(cfg: ConfigDict, c: Any, actor):
    """The distillation teacher (``distillation.teacher_models.teacher_model.model_path``), in the reference's
    dtypes; its vocabulary must cover the student's token ids (it scores the student's samples)."""
    from rlhf_jax.models.hub import resolve_model_path

    from rlhf_jax.config import model_hf_config

    key = "distillation.teacher_models.teacher_model.model_path"
    path = resolve_model_path(cfg.distillation.teacher_models.teacher_model.model_path)
    vocab = (model_hf_config(path) or {}).get("vocab_size")
    if vocab is not None and vocab < actor.config.vocab_size:
        raise ValueError(f"{key}: the teacher's vocabulary ({vocab} tokens) is smaller than the student's "
                         f"({actor.config.vocab_size}): distillation needs the student's tokenizer")
    loss = cfg.distillation.distillation_loss
    if loss.loss_mode == "forward_kl_topk":  # the student's log-probs are read at the teacher's top-k token ids
        if vocab is not None and vocab != actor.config.vocab_size:
            raise ValueError(f"{key}: forward_kl_topk compares distributions over one vocabulary; the teacher's has "
                             f"{vocab} tokens, the student's {actor.config.vocab_size}")
        if loss.topk > actor.config.vocab_size:
            raise ValueError(f"distillation.distillation_loss.topk={loss.topk} exceeds the vocabulary "
                             f"({actor.config.vocab_size} tokens)")
    return load_policy(cfg, c.model_path, c.mesh, c.rules, role="ref", path=path)
