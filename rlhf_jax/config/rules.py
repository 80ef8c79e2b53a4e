"""Rules between keys: the combinations rlhf_jax cannot honour, each a named function that raises one line naming the
key and what to set instead. A rule never changes a value (defaults are filled in :mod:`rlhf_jax.config.defaults`).

``@rule(*keys)`` (:mod:`rlhf_jax.config.rule`) records the keys a rule reads, so ``docs/CONFIG.md`` lists, for each
key, the rules that check it. Rules about devices, files, placement and the multi-turn loop are in
:mod:`rlhf_jax.config.rules_run`; :func:`rlhf_jax.config.validate.finalize` runs both, in registration order.
"""

from __future__ import annotations

import fnmatch
import os

from ml_collections import ConfigDict

from rlhf_jax import algos
from rlhf_jax.algos.rollout_correction import correction_from_config
from rlhf_jax.config import schema
from rlhf_jax.config.optimizers import optimizer_settings
from rlhf_jax.config.keys_distill import DISTILLATION_LOSS_MODES
from rlhf_jax.config.rule import Context, rule

A = "actor_rollout_ref."


def _differs(cfg: ConfigDict, path: str):
    value = schema.get_path(cfg, path)
    return value if value != schema.get_key(path).default else None


@rule("trainer.remove_previous_ckpt_in_save", "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
      given=True)
def checkpoints_kept(cfg: ConfigDict, ctx: Context) -> None:
    """One checkpoint holds actor and critic: one count of checkpoints kept."""
    t = cfg.trainer
    if t.remove_previous_ckpt_in_save and t.max_actor_ckpt_to_keep not in (None, 1):
        raise ValueError(f"trainer.remove_previous_ckpt_in_save keeps one checkpoint but trainer.max_actor_ckpt_to_keep="
                         f"{t.max_actor_ckpt_to_keep}: set one of them")
    actor = 1 if t.remove_previous_ckpt_in_save else t.max_actor_ckpt_to_keep
    if t.max_critic_ckpt_to_keep is not None and t.max_critic_ckpt_to_keep != actor:
        raise ValueError(f"trainer.max_critic_ckpt_to_keep={t.max_critic_ckpt_to_keep} differs from "
                         f"trainer.max_actor_ckpt_to_keep={actor}: one checkpoint holds actor and critic, so leave "
                         "max_critic_ckpt_to_keep unset")


# Settings of the RL loop (sampling, rewards, critic, the policy-gradient loss, experience rounds). A DPO run uses
# none of them, so one changed from its default stops the run by name: a key that is accepted does something.
RL_ONLY_PATTERNS = (
    A + "rollout.*", A + "actor.policy_loss.*", A + "actor.clip_ratio*", A + "actor.kl_loss_*",
    A + "actor.use_kl_loss", A + "actor.entropy_coeff", A + "actor.loss_agg_mode", A + "actor.loss_scale_factor",
    A + "actor.tis_imp_ratio_cap", A + "actor.ppo_epochs", A + "actor.use_dynamic_bsz",
    A + "actor.ppo_max_token_len_per_gpu", A + "actor.router_aux_loss_coef", A + "ref.log_prob_use_dynamic_bsz",
    A + "ref.log_prob_max_token_len_per_gpu", "critic.*", "reward_model.*", "custom_reward_function.*",
    "experience.*", "algorithm.*", "trainer.critic_warmup", "trainer.log_val_generations", "trainer.rollout_data_dir",
    "trainer.validation_data_dir", "trainer.max_critic_ckpt_to_keep", "data.ground_truth_key",
    "data.default_data_source", "mesh.rollout_devices", "mesh.rollout_processes", "mesh.handoff_timeout_s",
)
DPO_PATTERNS = ("algorithm.type", "algorithm.dpo.*")
RL_ONLY = tuple(p for p in schema.key_paths() if any(fnmatch.fnmatchcase(p, q) for q in RL_ONLY_PATTERNS)
                and not any(fnmatch.fnmatchcase(p, q) for q in DPO_PATTERNS))


@rule("algorithm.type", "algorithm.dpo.label_smoothing", "algorithm.dpo.loss_type", A + "model.use_remove_padding",
      *RL_ONLY, given=True)
def dpo_settings(cfg: ConfigDict, ctx: Context) -> None:
    """algorithm.type=dpo: label smoothing is the sigmoid loss's, rows are padded, the RL loop's keys stay unset."""
    if cfg.algorithm.type != "dpo":
        return
    d = cfg.algorithm.dpo
    if d.label_smoothing and d.loss_type != "sigmoid":
        raise ValueError(f"algorithm.dpo.label_smoothing={d.label_smoothing} applies to loss_type=sigmoid, not "
                         f"{d.loss_type}: set it to 0")
    if cfg.actor_rollout_ref.model.use_remove_padding:
        raise ValueError(f"{A}model.use_remove_padding=True: DPO runs padded batches (no packing yet); set it to "
                         "False")
    for path in RL_ONLY:
        value, default = schema.get_path(cfg, path), schema.get_key(path).default
        if value != default:
            raise ValueError(f"{path}={value!r} is a setting of the RL loop, which algorithm.type=dpo does not run: "
                             f"leave it at its default ({default!r})")


# Keys read only by the SFT trainer (algorithm.type=sft): set under another type they would do nothing.
SFT_ONLY = ("data.response_key", "data.multiturn.enable", "data.multiturn.messages_key", "data.multiturn.train_on",
            "data.max_length",
            "data.micro_batch_size_per_gpu", "trainer.val_accuracy")


@rule("algorithm.type", *SFT_ONLY)
def sft_only_keys(cfg: ConfigDict, ctx: Context) -> None:
    """Keys only the SFT trainer reads stay unset under another algorithm.type."""
    if cfg.algorithm.type == "sft":
        return
    for path in SFT_ONLY:
        if path == "data.max_length" and cfg.algorithm.type == "dpo":
            continue  # DPO's pairs are bounded by it too (data/preferences.py)
        if _differs(cfg, path) is not None:
            raise ValueError(f"{path}={schema.get_path(cfg, path)!r} is read by SFT only (algorithm.type=sft), not by "
                             f"algorithm.type={cfg.algorithm.type}; unset it (in a run with stages, set it in the SFT "
                             "stage)")


_OPTIM = tuple(f"{role}optim.{k}" for role in (A + "actor.", "critic.")
               for k in ("optimizer", "override_optimizer_config", "betas", "eps"))


@rule(*_OPTIM)
def optimizer_arguments(cfg: ConfigDict, ctx: Context) -> None:
    """The optimizer's further arguments have a meaning for it (Adafactor: betas / eps stay unset)."""
    for path, optim in ((A + "actor.optim", cfg.actor_rollout_ref.actor.optim), ("critic.optim", cfg.critic.optim)):
        optimizer_settings(str(optim.optimizer), optim.override_optimizer_config, f"{path}.override_optimizer_config")
        if str(optim.optimizer).lower() == "adafactor":  # its own moments: betas / eps would do nothing
            for name in ("betas", "eps"):
                default = schema.get_key(f"{path}.{name}").default
                value = tuple(optim[name]) if name == "betas" else optim[name]
                if value != default:
                    raise ValueError(f"{path}.{name}={optim[name]!r} has no meaning for Adafactor: leave it at "
                                     f"{default!r} and set {path}.override_optimizer_config (beta1, eps)")


@rule("reward_model.enable", "custom_reward_function.path", "reward_model.overlong_buffer.enable",
      "algorithm.filter_groups.enable", "algorithm.filter_groups.metric", "reward_model.model.input_tokenizer",
      "data.tokenizer")
def reward_model_alone(cfg: ConfigDict, ctx: Context) -> None:
    """The reward model's score is the reward: rule-based settings stay off, and it reads the policy's text."""
    if cfg.reward_model.enable:
        rm = "reward_model.enable=True scores with the reward model alone (as verl does)"
        if cfg.custom_reward_function.path:
            raise ValueError(f"{rm}: custom_reward_function.path would not be called; unset one of them")
        if cfg.reward_model.overlong_buffer.enable:
            raise ValueError(f"{rm}: reward_model.overlong_buffer applies to rule-based scores; unset one of them")
        if cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "acc":
            raise ValueError(f"{rm}, which has no 'acc': set algorithm.filter_groups.metric=score")
    policy_tokenizer = cfg.data.tokenizer or cfg.actor_rollout_ref.model.path
    rm_input = cfg.reward_model.model.input_tokenizer
    if cfg.reward_model.enable and rm_input and not _same_path(rm_input, policy_tokenizer):
        raise ValueError(f"reward_model.model.input_tokenizer={rm_input!r}: responses are decoded with the policy's "
                         f"tokenizer ({policy_tokenizer!r}) and re-tokenized with the reward model's; leave it unset "
                         "or set it to the policy's (change data.tokenizer to decode with another)")


def _same_path(a: str, b: str) -> bool:
    """Two model / tokenizer paths naming the same thing (a local directory in any spelling, or one Hub id)."""
    norm = lambda p: os.path.abspath(os.path.expanduser(p)) if os.path.exists(os.path.expanduser(p)) else p  # noqa: E731
    return norm(a) == norm(b)


@rule(A + "model.lora_rank", A + "model.lora_alpha", A + "model.lora_adapter_path")
def lora(cfg: ConfigDict, ctx: Context) -> None:
    """LoRA's scale is positive, and an adapter to start from needs a rank."""
    a, model = A + "model.", cfg.actor_rollout_ref.model
    if model.lora_rank and not model.lora_alpha > 0:
        raise ValueError(f"{a}lora_alpha={model.lora_alpha} must be > 0")
    if model.lora_adapter_path and not model.lora_rank:
        raise ValueError(f"{a}lora_adapter_path is set but {a}lora_rank=0: set lora_rank (and lora_alpha, "
                         "target_modules) to the adapter's")


@rule(A + "rollout.do_sample", A + "rollout.temperature", A + "rollout.val_kwargs.do_sample",
      A + "rollout.val_kwargs.temperature")
def sampling_temperature(cfg: ConfigDict, ctx: Context) -> None:
    """Sampling needs a positive temperature (greedy decoding is do_sample=False)."""
    rollout = cfg.actor_rollout_ref.rollout
    for prefix, sampling in (("rollout", rollout), ("rollout.val_kwargs", rollout.val_kwargs)):
        if sampling.do_sample and not sampling.temperature > 0:
            raise ValueError(f"{A}{prefix}.temperature={sampling.temperature} must be > 0 when "
                             f"{A}{prefix}.do_sample=True (set do_sample=False for greedy decoding)")


@rule("data.prompt_length_buckets", "data.max_prompt_length")
def prompt_length_buckets(cfg: ConfigDict, ctx: Context) -> None:
    """Prompt buckets ascend and fit in data.max_prompt_length."""
    buckets = cfg.data.prompt_length_buckets
    if buckets and (list(buckets) != sorted(set(buckets)) or buckets[0] < 1
                    or buckets[-1] > cfg.data.max_prompt_length):
        raise ValueError(f"data.prompt_length_buckets={buckets} must be strictly ascending positive lengths "
                         f"<= data.max_prompt_length ({cfg.data.max_prompt_length})")


@rule(A + "actor.policy_loss.loss_mode", A + "actor.policy_loss.dro_beta")
def dro_beta_set(cfg: ConfigDict, ctx: Context) -> None:
    """DRO's quadratic penalty needs its weight (verl's default is null)."""
    pl = cfg.actor_rollout_ref.actor.policy_loss
    if pl.loss_mode == "dro" and not (pl.dro_beta is not None and pl.dro_beta > 0):
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode=dro needs actor_rollout_ref.actor.policy_loss."
                         f"dro_beta > 0, got {pl.dro_beta}")


@rule("distillation.enabled", "distillation.teacher_models.teacher_model.model_path",
      "distillation.distillation_loss.loss_mode", "distillation.distillation_loss.use_policy_gradient",
      A + "actor.use_kl_loss", "algorithm.use_kl_in_reward", "algorithm.type")
def distillation_settings(cfg: ConfigDict, ctx: Context) -> None:
    """On-policy distillation needs its teacher, one of verl's loss modes (k1 only as a reward: its gradient does
    not depend on the teacher), and the reference's place (no KL term to a reference beside it)."""
    dist = cfg.distillation
    if not dist.enabled:
        return
    loss = dist.distillation_loss
    if not dist.teacher_models.teacher_model.model_path:
        raise ValueError("distillation.enabled needs distillation.teacher_models.teacher_model.model_path")
    if cfg.algorithm.type != "rl":
        raise ValueError(f"distillation.enabled: algorithm.type={cfg.algorithm.type} has no samples to distil on")
    if loss.loss_mode not in DISTILLATION_LOSS_MODES:
        raise ValueError(f"distillation.distillation_loss.loss_mode={loss.loss_mode!r} is not valid; choose from "
                         f"{', '.join(DISTILLATION_LOSS_MODES)}")
    if loss.loss_mode in ("kl", "k1") and not loss.use_policy_gradient:
        raise ValueError("distillation.distillation_loss.loss_mode=k1 as a loss has a gradient that does not depend "
                         "on the teacher: set use_policy_gradient=true, or loss_mode=k3")
    for key in (A + "actor.use_kl_loss", "algorithm.use_kl_in_reward"):
        if schema.get_path(cfg, key):
            raise ValueError(f"{key}=True with distillation.enabled: the teacher takes the reference's place, so "
                             "there is no reference to a KL term; turn one off")


@rule(A + "actor.policy_loss.loss_mode", "algorithm.rollout_correction.bypass_mode",
      "algorithm.rollout_correction.loss_type")
def bypass_loss(cfg: ConfigDict, ctx: Context) -> None:
    """Bypass mode's loss is algorithm.rollout_correction.loss_type's (verl replaces the policy loss with it), so a
    policy loss of another name would not be trained; bypass_mode is set by its key, not as a loss name; a
    loss_type without bypass mode would train nothing of its own."""
    mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    corr = cfg.algorithm.rollout_correction
    if corr.loss_type != "ppo_clip" and not corr.bypass_mode:
        raise ValueError(f"algorithm.rollout_correction.loss_type={corr.loss_type} is bypass mode's loss: set "
                         "algorithm.rollout_correction.bypass_mode=true (or leave loss_type at ppo_clip)")
    if cfg.algorithm.rollout_correction.bypass_mode and mode != "vanilla":
        raise ValueError(f"algorithm.rollout_correction.bypass_mode trains algorithm.rollout_correction.loss_type's "
                         f"loss, not actor_rollout_ref.actor.policy_loss.loss_mode={mode}: set loss_mode=vanilla")
    if mode == "bypass_mode":
        raise ValueError("actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode: set "
                         "algorithm.rollout_correction.bypass_mode=true instead")


@rule("algorithm.adv_estimator", "algorithm.rollout_correction.bypass_mode")
def sum_pi_squared_pass(cfg: ConfigDict, ctx: Context) -> None:
    """The optimal-token-baseline estimators read the old policy's sum_v pi_v^2, which only the old-log-prob pass
    computes; bypass mode skips that pass (verl fails the same way)."""
    adv = cfg.algorithm.adv_estimator
    if cfg.algorithm.rollout_correction.bypass_mode and algos.estimator_info(adv).needs_sum_pi_squared:
        raise ValueError(f"algorithm.adv_estimator={adv} reads the old policy's sum_pi_squared, which "
                         "algorithm.rollout_correction.bypass_mode=true does not compute (it skips the old-log-prob "
                         "pass): turn one of them off")


@rule("algorithm.adv_estimator", "algorithm.gdpo_reward_keys", "algorithm.gdpo_reward_weights")
def gdpo_components(cfg: ConfigDict, ctx: Context) -> None:
    """GDPO normalises named reward components (verl asserts that gdpo_reward_keys is set), one weight each."""
    alg = cfg.algorithm
    if alg.adv_estimator != "gdpo":
        return
    keys, weights = alg.gdpo_reward_keys, alg.gdpo_reward_weights
    if not keys:
        raise ValueError("algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the reward components your "
                         "reward function returns in its dict, e.g. ['format_reward', 'accuracy_reward']")
    if weights is not None and len(weights) != len(keys):
        raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(keys)} "
                         f"algorithm.gdpo_reward_keys {list(keys)}: give one weight per key")


@rule("algorithm.kl_penalty", "algorithm.use_kl_in_reward", A + "actor.kl_loss_type", A + "actor.use_kl_loss")
def kl_full_unsupported(cfg: ConfigDict, ctx: Context) -> None:
    """KL over the whole vocabulary (full) is not computed, as in verl."""
    actor, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    for path, kind, used in (("algorithm.kl_penalty", alg.kl_penalty, alg.use_kl_in_reward),
                             (A + "actor.kl_loss_type", actor.kl_loss_type, actor.use_kl_loss)):
        if used and kind == "full":
            raise ValueError(f"{path}=full (KL over the whole vocabulary) is not supported: it needs the reference's "
                             "distribution at every response position, not only its log-prob of the sampled token; "
                             "use low_var_kl (k3, unbiased and low-variance), kl (k1) or mse (k2)")


@rule("algorithm.adv_estimator", A + "rollout.n")
def group_estimator_needs_samples(cfg: ConfigDict, ctx: Context) -> None:
    """A grouped estimator compares the samples of one prompt: rollout.n >= 2."""
    alg, n = cfg.algorithm, cfg.actor_rollout_ref.rollout.n
    distilled_only = cfg.distillation.enabled and not cfg.distillation.distillation_loss.use_task_rewards
    if algos.estimator_info(alg.adv_estimator).grouped and n < 2 and not distilled_only:
        raise ValueError(f"algorithm.adv_estimator={alg.adv_estimator} compares the samples of one prompt: set "
                         f"actor_rollout_ref.rollout.n >= 2 (got {n})")


@rule("algorithm.adv_estimator", "critic.enable", "algorithm.type", "trainer.critic_warmup")
def critic_when_needed(cfg: ConfigDict, ctx: Context) -> None:
    """An estimator that reads values, and critic warm-up steps, need a critic."""
    alg = cfg.algorithm
    if algos.estimator_info(alg.adv_estimator).needs_critic and not cfg.critic.enable and alg.type == "rl":
        raise ValueError(f"algorithm.adv_estimator={alg.adv_estimator} needs a value model but critic.enable=False: "
                         "set critic.enable=True (or None), or pick a critic-free estimator such as grpo")
    if cfg.trainer.critic_warmup > 0 and not cfg.critic.enable:
        raise ValueError(f"trainer.critic_warmup={cfg.trainer.critic_warmup} needs a critic: set critic.enable=True "
                         "or trainer.critic_warmup=0")


@rule("reward_model.overlong_buffer.enable", "reward_model.overlong_buffer.len", A + "rollout.response_length")
def overlong_buffer_len(cfg: ConfigDict, ctx: Context) -> None:
    """DAPO's overlong buffer lies inside the response length."""
    ob, length = cfg.reward_model.overlong_buffer, cfg.actor_rollout_ref.rollout.response_length
    if ob.enable and not 0 < ob.len < length:
        raise ValueError(f"reward_model.overlong_buffer.len={ob.len} must be in (0, rollout.response_length={length})")


@rule("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is_threshold",
      "algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs_threshold",
      "algorithm.rollout_correction.rollout_rs_threshold_lower",
      "algorithm.rollout_correction.rollout_token_veto_threshold", A + "actor.tis_imp_ratio_cap")
def rollout_correction(cfg: ConfigDict, ctx: Context) -> None:
    """The off-policy correction's levels and thresholds fit together (algos.rollout_correction)."""
    correction_from_config(cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.actor.tis_imp_ratio_cap)


@rule("algorithm.filter_groups.enable", "algorithm.filter_groups.metric",
      "algorithm.use_kl_in_reward")
def filter_groups(cfg: ConfigDict, ctx: Context) -> None:
    """Dynamic sampling's metric is known before the KL."""
    alg, fg = cfg.algorithm, cfg.algorithm.filter_groups
    if fg.enable and fg.metric == "seq_final_reward" and alg.use_kl_in_reward:
        raise ValueError("algorithm.filter_groups.metric=seq_final_reward with use_kl_in_reward: the KL penalty is "
                         "known only after the group filter; use score or acc")


@rule("reward_model.reward_manager", "custom_reward_function.path")
def batch_manager_needs_function(cfg: ConfigDict, ctx: Context) -> None:
    """The batch reward manager calls a custom function."""
    if cfg.reward_model.reward_manager == "batch" and not cfg.custom_reward_function.path:
        raise ValueError("reward_model.reward_manager=batch calls custom_reward_function once per batch: set "
                         "custom_reward_function.path to a function taking lists (data_sources, solution_strs, "
                         "ground_truths, extra_infos), or use naive")


@rule("trainer.resume_mode", "trainer.resume_from_path")
def resume_path(cfg: ConfigDict, ctx: Context) -> None:
    """resume_mode=resume_path names the step to resume from."""
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path (a checkpoint step directory)")


_BUDGETS = ((A + "actor.use_dynamic_bsz", (A + "actor.ppo_max_token_len_per_gpu",), A + "model.use_remove_padding"),
            (A + "rollout.log_prob_use_dynamic_bsz", (A + "rollout.log_prob_max_token_len_per_gpu",),
             A + "model.use_remove_padding"),
            (A + "ref.log_prob_use_dynamic_bsz", (A + "ref.log_prob_max_token_len_per_gpu",),
             A + "model.use_remove_padding"),
            ("critic.use_dynamic_bsz", ("critic.ppo_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu"),
             "critic.model.use_remove_padding"))


@rule(*(k for flag, budgets, packing in _BUDGETS for k in (flag, *budgets, packing)), "critic.enable",
      "data.max_prompt_length", A + "rollout.response_length")
def token_budgets(cfg: ConfigDict, ctx: Context) -> None:
    """Token-budget micro-batches need packing, and a budget holds the longest possible sequence."""
    longest = cfg.data.max_prompt_length + cfg.actor_rollout_ref.rollout.response_length
    for flag, budgets, packing in _BUDGETS if cfg.critic.enable else _BUDGETS[:-1]:
        if not schema.get_path(cfg, flag):
            continue
        if not schema.get_path(cfg, packing):
            raise ValueError(f"{flag}=True packs sequences by a token budget and needs {packing}=True")
        for path in budgets:
            value = schema.get_path(cfg, path)
            if value != -1 and value < longest:
                raise ValueError(f"{path}={value} cannot hold one sequence of data.max_prompt_length + "
                                 f"rollout.response_length = {longest} tokens: raise it to >= {longest}, or -1 "
                                 "for the largest budget that fits in memory")


@rule("algorithm.sample_mask.difficulty", "algorithm.sample_mask.difficulty_low",
      "algorithm.sample_mask.difficulty_high", "algorithm.reward_norm.mean", "algorithm.reward_norm.std",
      A + "rollout.n", A + "rollout.multi_turn.per_turn_rewards", "algorithm.whiten_advantages",
      "algorithm.adv_estimator")
def score_shaping(cfg: ConfigDict, ctx: Context) -> None:
    """Group statistics need groups; normalised scores are one per response; GAE's advantages are whitened."""
    alg, n = cfg.algorithm, cfg.actor_rollout_ref.rollout.n
    mask = alg.sample_mask
    if mask.difficulty and not mask.difficulty_low < mask.difficulty_high:
        raise ValueError(f"algorithm.sample_mask.difficulty_low={mask.difficulty_low} must be below difficulty_high="
                         f"{mask.difficulty_high}: no group's mean score lies between them")
    for path, on in (("algorithm.sample_mask.difficulty", mask.difficulty),
                     ("algorithm.reward_norm.mean=group", alg.reward_norm.mean == "group"),
                     ("algorithm.reward_norm.std=group", alg.reward_norm.std == "group")):
        if on and n < 2:
            raise ValueError(f"{path} compares the samples of one prompt: set actor_rollout_ref.rollout.n >= 2 "
                             f"(got {n})")
    normalised = alg.reward_norm.mean is not None or alg.reward_norm.std is not None
    if normalised and cfg.actor_rollout_ref.rollout.multi_turn.per_turn_rewards:
        raise ValueError("algorithm.reward_norm normalises one score per response, but "
                         "actor_rollout_ref.rollout.multi_turn.per_turn_rewards gives one per turn: unset one")
    if alg.whiten_advantages and algos.estimator_info(alg.adv_estimator).needs_critic:
        raise ValueError(f"algorithm.whiten_advantages: adv_estimator={alg.adv_estimator} whitens its advantages "
                         "already; leave whiten_advantages False")
