"""Schema keys of ``actor_rollout_ref``: the policy model, its optimizer, the reference and the sampler.

Names and meanings follow verl's ``ppo_trainer.yaml``; batch sizes in prompts
(``ppo_mini_batch_size``) are multiplied by ``rollout.n`` like verl, and
``*_per_gpu`` sizes are per data-parallel shard (one shard = one position on
the ``data`` x ``fsdp`` mesh axes).
"""

from __future__ import annotations

from rlhf_jax import algos
from rlhf_jax.config.key import Check, Key, above, at_least, finite_non_negative, fraction, micro_size, registered
from rlhf_jax.config.names import (ATTN_IMPLEMENTATIONS, CKPT_CONTENTS, DTYPES, OPTIMIZER_NAMES, REMAT_POLICIES,
                                   TOOL_RESPONSE_TRUNCATION, WARMUP_STYLES)

TOKEN_BUDGET_DOC = " (when {flag}; -1 = the largest that fits in memory)"
A = "actor_rollout_ref."


# optim.optimizer, compared lower-case (verl writes AdamW)
OPTIMIZER = Check(lambda v: str(v).lower() in OPTIMIZER_NAMES,
                  f": choose one of {', '.join(OPTIMIZER_NAMES.values())}")


def optim_keys(prefix: str, lr: float) -> tuple[Key, ...]:
    """AdamW + schedule keys shared by actor and critic (``<prefix>optim.*``)."""
    p = prefix + "optim."
    return (
        Key(p + "optimizer", "AdamW", "AdamW, Adam, SGD (as in PyTorch: Adam's and SGD's decay is L2), Lion, or "
            "Adafactor (as in transformers, with lr from lr and its schedule); case-insensitive.", check=OPTIMIZER),
        Key(p + "override_optimizer_config", None, "The optimizer class's further keyword arguments (PyTorch / "
            "transformers names): see 'optimizer arguments'; others stop the run by name.", type=object),
        Key(p + "lr", lr, "Peak learning rate.", check=finite_non_negative()),
        Key(p + "lr_warmup_steps", -1, "Linear warmup steps; negative: use lr_warmup_steps_ratio."),
        Key(p + "lr_warmup_steps_ratio", 0.0, "Warmup steps as a fraction of the total training steps."),
        Key(p + "warmup_style", "constant", "Schedule after warmup: constant, cosine or linear decay, or wsd "
            "(warmup-stable-decay: constant for 90 % of the rest, then cosine; verl's SFT lr_scheduler).",
            choices=WARMUP_STYLES),
        Key(p + "min_lr_ratio", 0.0, "Final lr as a fraction of lr (cosine and linear decay).",
            check=finite_non_negative()),
        Key(p + "num_cycles", 0.5, "Cosine cycles over the decay phase (0.5 = half a cosine, verl's default)."),
        Key(p + "weight_decay", 0.01, "Weight decay (decoupled for AdamW, Lion and Adafactor; L2 for Adam and SGD).",
            check=finite_non_negative()),
        Key(p + "betas", (0.9, 0.999), "(beta1, beta2) of AdamW, Adam and Lion."),
        Key(p + "eps", 1e-8, "Epsilon of AdamW and Adam.", check=finite_non_negative()),
    )


def checkpoint_keys(prefix: str, exported: bool = True) -> tuple[Key, ...]:
    """What a checkpoint of this role holds (``<prefix>checkpoint.*``); ``exported``: the role has an HF export."""
    p = prefix + "checkpoint."
    no_export = Check(lambda v: "hf_model" not in v, ": without hf_model",
                      lambda v: f"{p}save_contents: hf_model is not supported (only the actor is exported as a Hugging "
                                "Face directory); remove it")
    return (
        Key(p + "save_contents", ("model", "optimizer", "extra"),
            "What checkpoints hold: model (weights), optimizer, extra (actor: data position, KL coefficient), "
            "hf_model (actor: an HF export with every checkpoint).",
            choices=CKPT_CONTENTS, check=None if exported else no_export),
        Key(p + "load_contents", None, "What a resume restores; None = save_contents.", type=tuple,
            choices=CKPT_CONTENTS, same_as=p + "save_contents"),
    )


MODEL = (
    Key(A + "model.path", "builtin:tiny",
        "Policy checkpoint: a local HF directory, a Hub id (org/name; from the HF cache if HF_HUB_OFFLINE=1), "
        "builtin:tiny (small random Llama) or builtin:smollm2."),
    Key(A + "model.revision", None, "Hub revision (branch, tag or commit) of a Hub id model.path; None = main.",
        type=str),
    Key(A + "model.dtype", "float32", "Parameter (and optimizer state) dtype.", choices=DTYPES),
    Key(A + "model.compute_dtype", "float32", "Activation / matmul dtype of forward passes.", choices=DTYPES),
    Key(A + "model.enable_gradient_checkpointing", False,
        "Rematerialize each decoder layer in the backward pass (policy: model.remat_policy)."),
    Key(A + "model.remat_policy", "full",
        "What a rematerialized layer keeps when enable_gradient_checkpointing is on: full (nothing; least memory) "
        "or dots_saveable (matmul outputs; less recompute).", choices=REMAT_POLICIES),
    Key(A + "model.attn_implementation", "auto",
        "Attention of training passes and prefill: auto (cuDNN flash on GPU, Pallas splash on TPU, blockwise or "
        "dense on CPU by length), dense, blockwise (flash-style, memory linear in length), cudnn, splash.",
        choices=ATTN_IMPLEMENTATIONS),
    Key(A + "model.use_remove_padding", True,
        "Pack sequences in rows for the training passes, the samples of a prompt sharing one copy of it (no "
        "FLOPs on padding or repeated prompts; exact). False = padded rows cut to the longest ones."),
    Key(A + "model.lora_rank", 0,
        "LoRA rank of the actor's adapters; 0 = off (every weight trains). With LoRA only the adapters train and "
        "the reference is the base model with the adapters off.", check=at_least(0, " (0 = no LoRA)")),
    Key(A + "model.lora_alpha", 16.0, "LoRA scaling: adapters are scaled by lora_alpha / lora_rank (PEFT's meaning)."),
    Key(A + "model.target_modules", ("all-linear",),
        "Modules that get adapters, as PEFT reads them: all-linear or names (q_proj ... down_proj; MoE: gate, "
        "shared_expert_gate). On MoE models see docs/models.md.", type=tuple),
    Key(A + "model.lora_adapter_path", None,
        "A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from; its r, "
        "lora_alpha and target_modules must equal the keys above.", type=str),
)

ACTOR = (
    Key(A + "actor.ppo_mini_batch_size", 8,
        "Prompts per PPO mini-batch (one optimizer step); multiplied by rollout.n like verl.", check=at_least(1)),
    Key(A + "actor.ppo_micro_batch_size_per_gpu", 1,
        "Sequences per forward/backward on each data-parallel shard; -1 = automatic (all that fit; on CPU cache-sized).",
        check=micro_size()),
    Key(A + "actor.use_dynamic_bsz", False,
        "Choose micro-batches by a token budget (ppo_max_token_len_per_gpu, log_prob_max_token_len_per_gpu) "
        "instead of a sequence count; needs model.use_remove_padding."),
    Key(A + "actor.ppo_max_token_len_per_gpu", 16384,
        "Packed tokens per actor forward/backward on each data-parallel shard" + TOKEN_BUDGET_DOC.format(flag="use_dynamic_bsz")),
    Key(A + "actor.ppo_epochs", 1, "Passes over each rollout batch.", check=at_least(1)),
    Key(A + "actor.shuffle", False, "Shuffle the rollout batch between PPO epochs."),
    Key(A + "actor.grad_clip", 1.0, "Clip the global gradient norm to this value (<= 0: no clipping)."),
    Key(A + "actor.clip_ratio", 0.2, "PPO clip epsilon; default for clip_ratio_low and clip_ratio_high.",
        check=above(0)),
    Key(A + "actor.tis_imp_ratio_cap", -1.0, "verl's older switch for truncated importance sampling: > 0 is "
        "algorithm.rollout_correction.rollout_is=token with this rollout_is_threshold; <= 0 = off."),
    Key(A + "actor.calculate_sum_pi_squared", False, "Also compute sum_v pi_v^2 per token in the old-log-prob pass "
        "(chunked with the log-probs) and log verl's variance_proxy/ metrics; the optimal-token-baseline estimators "
        "turn it on themselves."),
    Key(A + "actor.clip_ratio_low", None, "Lower clip epsilon (ratio >= 1 - low); None = clip_ratio.", type=float,
        check=above(0), same_as="actor_rollout_ref.actor.clip_ratio"),
    Key(A + "actor.clip_ratio_high", None, "Upper clip epsilon (ratio <= 1 + high); None = clip_ratio.", type=float,
        check=above(0), same_as="actor_rollout_ref.actor.clip_ratio"),
    Key(A + "actor.clip_ratio_c", 3.0, "Dual-clip constant c > 1 bounding the loss for negative advantages.",
        check=above(1, " (dual-clip bound)")),
    Key(A + "actor.entropy_coeff", 0.0, "Weight of the entropy bonus subtracted from the policy loss.",
        check=at_least(0)),
    Key(A + "actor.use_kl_loss", False, "Add a KL(actor || ref) loss term (GRPO style); loads the reference."),
    Key(A + "actor.kl_loss_coef", 0.001, "Weight of the KL loss.", check=at_least(0)),
    Key(A + "actor.router_aux_loss_coef", None,
        "MoE actor: weight of the router load-balancing loss; None = the checkpoint's if output_router_logits, else 0.",
        type=float, check=at_least(0)),
    Key(A + "actor.router_replay.mode", "disabled",
        "MoE actor routing replay: R3 = old-log-prob, ref and update passes reuse the sampler's expert ids; R2 = the "
        "update reuses the old-log-prob pass's.", choices=("disabled", "R2", "R3")),
    Key(A + "actor.kl_loss_type", "low_var_kl",
        "KL estimator of the KL loss: kl|k1, abs, mse|k2, low_var_kl|k3 (full is not supported).",
        check=registered(A + "actor.kl_loss_type", algos.check_kl_kind)),
    Key(A + "actor.loss_agg_mode", "token-mean",
        "Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm.",
        check=registered(A + "actor.loss_agg_mode", algos.check_loss_agg_mode)),
    Key(A + "actor.loss_scale_factor", None,
        "Constant divisor of seq-mean-token-sum-norm; None = rollout.response_length.", type=float),
    Key(A + "actor.policy_loss.loss_mode", "vanilla",
        "Policy loss: vanilla (PPO dual-clip), gspo, gpg, cispo, clip_cov, kl_cov, geo_mean (GMPO), sapo, dro, dppo_tv, "
        "dppo_kl, or a registered name.",
        check=registered(A + "actor.policy_loss.loss_mode", algos.check_policy_loss)),
    Key(A + "actor.policy_loss.clip_cov_ratio", 0.0002, "clip_cov: fraction of tokens whose gradient is dropped."),
    Key(A + "actor.policy_loss.clip_cov_lb", 1.0, "clip_cov: lower covariance bound of eligible tokens."),
    Key(A + "actor.policy_loss.clip_cov_ub", 5.0, "clip_cov: upper covariance bound of eligible tokens."),
    Key(A + "actor.policy_loss.kl_cov_ratio", 0.0002, "kl_cov: fraction of tokens (top covariance) given a KL penalty."),
    Key(A + "actor.policy_loss.ppo_kl_coef", 0.1, "kl_cov: weight of the |log-ratio| penalty (verl's 0.1)."),
    Key(A + "actor.policy_loss.dro_beta", None, "dro: weight of the quadratic log-ratio penalty (> 0; verl's null "
        "must be set when loss_mode=dro).", type=float),
    Key(A + "actor.tau_pos", 1.0, "sapo: gate temperature of tokens with a positive advantage.", check=above(0)),
    Key(A + "actor.tau_neg", 1.05, "sapo: gate temperature of the other tokens.", check=above(0)),
    Key(A + "actor.freeze.freeze_emb", False, "Freeze the token embedding (no gradient, no optimizer state)."),
    Key(A + "actor.freeze.freeze_ln", False, "Freeze every norm weight (layer norms, q/k norms, the final norm)."),
    Key(A + "actor.freeze.freeze_attn", False, "Freeze the attention projections (and their biases)."),
    Key(A + "actor.freeze.freeze_ff", False, "Freeze the MLP (dense, or a MoE block's router and experts)."),
    Key(A + "actor.freeze.freeze_other", False, "Freeze the remaining parameters (an untied lm_head)."),
    Key(A + "actor.freeze.layers_not_to_freeze", (), "Decoder layer indices trained whatever the freeze flags say.",
        type=tuple),
    Key(A + "actor.fsdp_config.param_offload", False, "Keep the actor's parameters in host memory between programs; "
        "each pass copies them to the devices. Under LoRA: the frozen base only."),
    Key(A + "actor.fsdp_config.optimizer_offload", False, "Keep the actor's optimizer state in host memory between "
        "updates; each update copies it to the devices and writes it back."),
) + optim_keys(A + "actor.", 1e-6) + checkpoint_keys(A + "actor.")

REF = (
    Key(A + "ref.log_prob_micro_batch_size_per_gpu", 2,
        "Sequences per reference-model forward pass on each data-parallel shard; -1 = all.", check=micro_size()),
    Key(A + "ref.log_prob_use_dynamic_bsz", None,
        "Token-budget micro-batches for the reference pass; None = actor.use_dynamic_bsz.", type=bool,
        same_as="actor_rollout_ref.actor.use_dynamic_bsz"),
    Key(A + "ref.log_prob_max_token_len_per_gpu", None,
        "Tokens per reference forward pass on each shard; None = actor.ppo_max_token_len_per_gpu" +
        TOKEN_BUDGET_DOC.format(flag="ref.log_prob_use_dynamic_bsz"), type=int,
        same_as="actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    Key(A + "ref.fsdp_config.param_offload", False,
        "Keep the reference's parameters in host memory (pinned_host); each reference pass copies them to the "
        "devices. Under LoRA the reference is the actor's base (actor.fsdp_config.param_offload).",
        type=bool),
)

ROLLOUT = (
    Key(A + "rollout.over_sample_rate", 0.0, "Multi-turn training rollouts end once 1 - this share of the "
        "trajectories is done; the rest train as empty responses (verl's over-sampling against the long tail).",
        check=Check(lambda v: 0 <= v < 1, " must be in [0, 1)")),
    Key(A + "rollout.n", 1, "Responses sampled per prompt (> 1 for grpo, rloo and other group estimators).",
        check=at_least(1)),
    Key(A + "rollout.temperature", 1.0, "Sampling temperature (also used to scale logits for training log-probs).",
        check=above(0, " (it scales training log-probs)")),
    Key(A + "rollout.top_k", -1, "Keep the k most likely tokens; -1 or 0 = off."),
    Key(A + "rollout.top_p", 1.0, "Nucleus sampling mass; 1.0 = off.", check=fraction()),
    Key(A + "rollout.do_sample", True, "Sample; False = greedy decoding."),
    Key(A + "rollout.response_length", None, "Tokens generated per response; None = data.max_response_length.",
        type=int, check=at_least(1), same_as="data.max_response_length"),
    Key(A + "rollout.ignore_eos", False, "Keep generating after EOS (benchmarking)."),
    Key(A + "rollout.min_new_tokens", 0,
        "No EOS before this many response tokens (HF's min_new_tokens), in training and validation; 0 = off."),
    Key(A + "rollout.seed", None, "Base PRNG seed of sampling; None = trainer.seed.", type=int, same_as="trainer.seed"),
    Key(A + "rollout.dtype", None, "Compute dtype of sampling (the KV cache's too); parameters keep their dtype and "
        "are cast at use. None = model.compute_dtype.", type=str, choices=DTYPES,
        same_as="actor_rollout_ref.model.compute_dtype"),
    Key(A + "rollout.weight_dtype", None,
        "Sampler weights' dtype: a copy of the actor's in it per rollout (as verl's engine holds its own; bfloat16 "
        "halves decode's reads). None = no copy (model.dtype).",
        type=str, choices=DTYPES),
    Key(A + "rollout.max_num_seqs", None,
        "Decode slots (sequences decoded at once; a finished one is refilled from the pending samples); "
        "rounded down to a multiple of the data-parallel size. None = every sample of the batch, at most 256.",
        type=int),
    Key(A + "rollout.log_prob_micro_batch_size_per_gpu", 2,
        "Sequences per old-log-prob forward pass on each data-parallel shard; -1 = all.", check=micro_size()),
    Key(A + "rollout.log_prob_use_dynamic_bsz", None,
        "Token-budget micro-batches for the old-log-prob pass; None = actor.use_dynamic_bsz.", type=bool,
        same_as="actor_rollout_ref.actor.use_dynamic_bsz"),
    Key(A + "rollout.log_prob_max_token_len_per_gpu", None,
        "Tokens per old-log-prob forward pass on each shard; None = actor.ppo_max_token_len_per_gpu" +
        TOKEN_BUDGET_DOC.format(flag="rollout.log_prob_use_dynamic_bsz"), type=int,
        same_as="actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    Key(A + "rollout.val_kwargs.temperature", 0.0, "Validation sampling temperature."),
    Key(A + "rollout.val_kwargs.top_k", -1, "Validation top-k; -1 or 0 = off."),
    Key(A + "rollout.val_kwargs.top_p", 1.0, "Validation nucleus mass.", check=fraction()),
    Key(A + "rollout.val_kwargs.n", 1, "Responses per validation prompt.", check=at_least(1)),
    Key(A + "rollout.val_kwargs.do_sample", False, "Sample during validation; False = greedy."),
)

_MT = A + "rollout.multi_turn."
MULTI_TURN = (
    Key(_MT + "enable", False, "Multi-turn tool-calling rollouts: decode a turn, run its tool calls, append the "
        "tool responses (chat template) and continue from the KV cache; tool tokens are not trained."),
    Key(_MT + "max_assistant_turns", None, "Assistant turns per trajectory (>= 1); None = until "
        "rollout.response_length is used up.", type=int, check=at_least(1, " (or null)"), check_if=_MT + "enable"),
    Key(_MT + "max_user_turns", None, "Tool-response turns per trajectory; None = no limit but the length.",
        type=int, check=at_least(1, " (or null)"), check_if=_MT + "enable"),
    Key(_MT + "max_tokens_per_turn", None, "Tokens one assistant turn may draw; None = what is left of "
        "rollout.response_length (which counts assistant and tool tokens together).", type=int,
        check=at_least(1, " (or null)"), check_if=_MT + "enable"),
    Key(_MT + "tools", (), "Names of registered tools the model may call (built-ins: calculator, python).",
        type=tuple),
    Key(_MT + "tool_config_path", None, "verl-style tool YAML (tools: - tool_schema: {function: {name: ...}}); "
        "each name must be a registered tool.", type=str),
    Key(_MT + "format", "hermes", "Tool-call parser by name (hermes: <tool_call>{json}</tool_call>)."),
    Key(_MT + "max_parallel_calls", 1, "Tool calls run per turn; a turn's further calls are dropped.",
        check=at_least(1, " (or null)"), check_if=_MT + "enable"),
    Key(_MT + "max_tool_response_length", 256, "Characters of a tool's output shown to the model; None = all.",
        type=int, check=at_least(1, " (or null)"), check_if=_MT + "enable"),
    Key(_MT + "tool_response_truncate_side", "middle", "Which part of a long tool output is kept.",
        choices=TOOL_RESPONSE_TRUNCATION),
    Key(_MT + "tool_timeout_s", 30.0, "Seconds a tool call may run before it returns a timeout error.",
        check=above(0), check_if=_MT + "enable"),
    Key(_MT + "environment", None, "An environment (registered name, e.g. guess_number, or path.py:Class) that "
        "answers each turn; reset(task) gives the prompt, its summed rewards are the score.", type=str),
    Key(_MT + "environments", None, "Named environments {name: {environment: registered name or path.py:Class, ...}}; "
        "a task whose extra_info.env is a name plays it, the entry as task['env_config'] (ROLL's custom_envs).",
        type=object),
    Key(_MT + "workflow", None, "A workflow fn(client, task) -> reward (registered name or path.py:function) that "
        "drives the policy through an OpenAI-style client; its episode is trained with that reward.", type=str),
    Key(_MT + "per_turn_rewards", False, "Each environment reward on the last token of the turn it answers (token-"
        "level: GAE / REINFORCE++ credit each turn); False = their sum on the last token. GRPO-like see the sum."),
    Key(_MT + "interaction_config_path", None, "verl's interaction YAML: a simulated user answers each turn without "
        "tool calls (rows pick one by extra_info.interaction_kwargs.name; docs/multi_turn.md).", type=str),
    Key(_MT + "workflow_args", None, "A mapping handed to every task of the workflow as task['workflow_args'] "
        "(Trinity's workflow_args).", type=object),
)

KEYS: tuple[Key, ...] = MODEL + ACTOR + REF + ROLLOUT + MULTI_TURN
