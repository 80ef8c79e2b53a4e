"""Schema keys of ``data``, ``critic``, ``reward_model``, ``custom_reward_function``, ``algorithm``,
``trainer``, with ``mesh`` and ``experience`` from :mod:`keys_placement` (verl names wherever verl has the concept)."""

from __future__ import annotations

import importlib
import re

from rlhf_jax import algos
from rlhf_jax.algos.dpo import LOSS_TYPES
from rlhf_jax.algos.kl import KL_CTRL_TYPES
from rlhf_jax.algos.bypass import BYPASS_LOSS_TYPES
from rlhf_jax.algos.rollout_correction import IS_LEVELS, RS_LEVELS
from rlhf_jax.config.domain_weights import weights_problem
from rlhf_jax.config.key import Check, Key, above, at_least, micro_size, registered, step_numbers, within
from rlhf_jax.config.keys_placement import EXPERIENCE, MESH
from rlhf_jax.config.keys_policy import TOKEN_BUDGET_DOC, checkpoint_keys, optim_keys
from rlhf_jax.config.keys_shaping import SHAPING
from rlhf_jax.config.names import (ANSWER_MATCH_MODES, FILTER_GROUP_METRICS, LOGGERS,
                                   PROMPT_TRUNCATION, REMAT_POLICIES, RESUME_MODES, REWARD_MANAGERS, TRAINER_TYPES)

# trainer.logger entries that are optional packages: name -> (module, pip command)
OPTIONAL_TRACKERS = {"wandb": ("wandb", "pip install wandb"), "mlflow": ("mlflow", "pip install mlflow")}


def _missing_tracker(backends: tuple) -> str | None:
    """A missing wandb / mlflow package stops the run before anything is built, with the pip command."""
    for name in backends:
        if name not in OPTIONAL_TRACKERS:
            continue
        module, pip = OPTIONAL_TRACKERS[name]
        try:
            importlib.import_module(module)
        except ImportError:
            return (f"trainer.logger includes {name!r} but the {module} package is not installed: {pip} "
                    f"(or pip install 'rlhf_jax[{name}]'), or remove {name!r} from trainer.logger")
    return None


TRACKERS_INSTALLED = Check(lambda v: _missing_tracker(v) is None, ": the optional packages named are installed",
                           _missing_tracker)
# algorithm.type: the message names the trainers (as a stage override's check does, names.check_type)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env_vars_problem(value) -> str | None:
    if not isinstance(value, dict) and not hasattr(value, "items"):
        return f"trainer.env_vars={value!r} must be a mapping of variable names to strings"
    for name, v in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            return f"trainer.env_vars: {name!r} is not an environment variable name"
        if not isinstance(v, str):
            return f"trainer.env_vars.{name}={v!r} must be a string (quote it: {name}: '{v}')"
    return None


ENV_VARS = Check(lambda v: v is None or _env_vars_problem(v) is None, ": a mapping of variable names to strings",
                 explain=_env_vars_problem)
DOMAIN_WEIGHTS = Check(lambda v: weights_problem(v) is None, ": {domain: weight >= 0}, those before the last <= 1 in all",
                       explain=weights_problem)
TRAINER_TYPE = Check(lambda v: v in TRAINER_TYPES, f" is not valid: choose one of {', '.join(sorted(TRAINER_TYPES))}")

DATA = (
    Key("data.train_files", ("builtin:arithmetic",),
        "Training prompts: parquet/json/jsonl/csv files or directories, or builtin:<name> (generated on first use)."),
    Key("data.val_files", ("builtin:arithmetic",), "Validation prompts, same forms as train_files."),
    Key("data.train_split", "train", "Split read from split-keyed JSON, split-named files in a directory, or builtin sets."),
    Key("data.val_split", "test", "Split read for validation (see train_split)."),
    Key("data.train_max_samples", -1, "Use at most this many training rows (a random subset when data.shuffle, else "
        "the first ones); <= 0 = all."),
    Key("data.val_max_samples", -1, "Use at most this many validation rows (the first ones); <= 0 = all."),
    Key("data.tokenizer", None, "Tokenizer directory or Hub id (at main); None = the one in "
        "actor_rollout_ref.model.path.", type=str),
    Key("data.prompt_key", None, "Prompt column (a string or chat messages); None = first of prompt, messages, question, "
        "query, problem, instruction (any case).", type=str),
    Key("data.chosen_key", "chosen", "Preference data (algorithm.type=dpo): column of the preferred response (a string "
        "or the assistant's chat messages)."),
    Key("data.rejected_key", "rejected", "Preference data (algorithm.type=dpo): column of the dispreferred response "
        "(a string or chat messages); a row without it stops the run naming file and row."),
    Key("data.ground_truth_key", None, "Dotted path of the ground truth in a row; None = first of "
        "reward_model.ground_truth, ground_truth, answer, solution, target, label, response; '' = none.", type=str),
    Key("data.default_data_source", None,
        "data_source for rows without one (selects the rule-based scorer); None = the file's name.", type=str),
    Key("data.image_key", "images", "Column of a row's images: rows with images there are refused (text-only "
        "models); None = not checked.", type=str),
    Key("data.video_key", "videos", "Column of a row's videos: rows with videos there are refused; None = not "
        "checked.", type=str),
    Key("data.chat_template", None, "Chat template (Jinja text or a .jinja file) replacing the tokenizer's for "
        "prompt_template=native; exported with the model. None = the tokenizer's.", type=str),
    Key("data.prompt_template", "native",
        "native (the tokenizer's chat template), raw (text as is) or a str.format template with {prompt}."),
    Key("data.system_prompt", None, "System message added to every prompt; None = none.", type=str),
    Key("data.apply_chat_template_kwargs", None, "Keyword arguments of the tokenizer's chat template (native), e.g. "
        "{'enable_thinking': False}; None = none.", type=object),
    Key("data.max_prompt_length", 128, "Prompt tokens; prompts are left-padded to this (or a bucket).",
        check=at_least(1)),
    Key("data.max_response_length", 16, "Response tokens; default for actor_rollout_ref.rollout.response_length.",
        check=at_least(1)),
    Key("data.prompt_length_buckets", None,
        "Padded prompt lengths to compile for (ascending, up to max_prompt_length); None = powers of two from 16.",
        type=tuple),
    Key("data.truncation", "error", "Overlong prompts: error, or keep the left end / right end / both ends.",
        choices=PROMPT_TRUNCATION),
    Key("data.filter_overlong_prompts", False, "Drop prompts longer than max_prompt_length instead of truncating."),
    Key("data.train_batch_size", 16, "Prompts per training step (each sampled rollout.n times).", check=at_least(1)),
    Key("data.val_batch_size", None, "Prompts per validation batch; None = the whole validation set.", type=int,
        check=at_least(1)),
    Key("data.shuffle", True, "Shuffle training prompts (reshuffled every epoch)."),
    Key("data.seed", 1, "Seed of the data shuffle."),
    Key("data.domain_weights", None, "Sample training prompts by domain, {domain: weight}: each batch takes int(w x "
        "batch) of a domain, the last the rest; None = no (docs/data_and_rewards.md).", type=object,
        check=DOMAIN_WEIGHTS),
    Key("data.domain_key", "domain", "Column naming a training row's domain (with data.domain_weights)."),
    Key("data.domain_tags", None, "{domain: [tags]}: a row without a domain column takes the domain listing its "
        "data.tag_key value; None = none.", type=object),
    Key("data.tag_key", "tag", "Column of a row's tag (data.domain_tags)."),
    Key("data.default_domain", None, "Domain of a row that names none (data.domain_key, data.domain_tags); None = "
        "such a row is an error.", type=str),
    # Supervised fine-tuning (algorithm.type=sft), verl's sft_trainer names
    Key("data.response_key", None, "SFT: response column of single-turn rows; None = first of response, answer, "
        "completion, output (any case).", type=str),
    Key("data.multiturn.enable", False, "SFT: rows are chat conversations (data.multiturn.messages_key); the loss "
        "covers every assistant message."),
    Key("data.multiturn.messages_key", "messages", "SFT: column of the conversation (a list of role/content "
        "messages) when data.multiturn.enable."),
    Key("data.multiturn.train_on", "all", "SFT conversations: all (the loss covers every assistant message) or last "
        "(only the final assistant message; the turns before it are context, as Trinity-RFT trains a conversation).",
        choices=("all", "last")),
    Key("data.max_length", None, "SFT: tokens per example (longer: data.truncation); None = max_prompt_length + "
        "max_response_length. DPO: most tokens of prompt + either response (longer: filter_overlong_prompts).",
        type=int),
    Key("data.micro_batch_size_per_gpu", -1, "SFT: per shard and forward/backward, sequences (padded rows) or packed "
        "rows of max_length tokens (model.use_remove_padding); -1 = the whole per-shard batch."),
)

_C = "critic."
CRITIC = (
    Key(_C + "enable", None, "Train a value model; None = when the estimator needs one (gae) and algorithm.type=rl.",
        type=bool),
    Key(_C + "shared_trunk", False, "The value model is a head on the actor's trunk: one forward pass gives log-probs "
        "and values, one loss trains both (seed 000's actor_critic)."),
    Key(_C + "vf_coef", 0.1, "With critic.shared_trunk: weight of the clipped value loss in the joint loss (TRL's)."),
    Key(_C + "model.path", None, "Critic initialisation checkpoint (a directory or Hub id); None = "
        "actor_rollout_ref.model.path.", type=str, same_as="actor_rollout_ref.model.path"),
    Key(_C + "model.revision", None, "Hub revision of a Hub id critic.model.path; None = main.", type=str),
    Key(_C + "model.enable_gradient_checkpointing", False, "Rematerialize each critic decoder layer."),
    Key(_C + "model.fsdp_config.param_offload", False, "Keep the critic's parameters in host memory between "
        "programs; each pass copies them to the devices (verl's newer critic.fsdp.param_offload)."),
    Key(_C + "model.fsdp_config.optimizer_offload", False, "Keep the critic's optimizer state in host memory between "
        "updates (verl's newer critic.fsdp.optimizer_offload)."),
    Key(_C + "model.remat_policy", None, "Critic remat policy (full, dots_saveable); None = the actor's.", type=str,
        choices=REMAT_POLICIES, same_as="actor_rollout_ref.model.remat_policy"),
    Key(_C + "model.use_remove_padding", None, "Pack sequences in the critic passes; None = the actor's.", type=bool,
        same_as="actor_rollout_ref.model.use_remove_padding"),
    Key(_C + "use_dynamic_bsz", None, "Token-budget critic micro-batches; None = actor.use_dynamic_bsz.", type=bool,
        same_as="actor_rollout_ref.actor.use_dynamic_bsz"),
    Key(_C + "ppo_max_token_len_per_gpu", None,
        "Tokens per critic forward/backward on each shard; None = 2 x the actor's budget (verl)" +
        TOKEN_BUDGET_DOC.format(flag="critic.use_dynamic_bsz"), type=int),
    Key(_C + "forward_max_token_len_per_gpu", None,
        "Tokens per value forward pass on each shard; None = critic.ppo_max_token_len_per_gpu.", type=int,
        same_as="critic.ppo_max_token_len_per_gpu"),
    Key(_C + "ppo_mini_batch_size", None, "Prompts per critic mini-batch (x rollout.n); None = the actor's.",
        type=int, check=at_least(1), check_if="critic.enable", same_as="actor_rollout_ref.actor.ppo_mini_batch_size"),
    Key(_C + "ppo_micro_batch_size_per_gpu", None,
        "Sequences per critic forward/backward on each data-parallel shard; None = the actor's; -1 = automatic "
        "(as the actor's).", type=int,
        check=micro_size(), check_if="critic.enable", same_as="actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    Key(_C + "forward_micro_batch_size_per_gpu", None,
        "Sequences per value forward pass on each data-parallel shard; None = ppo_micro_batch_size_per_gpu.",
        type=int, check=micro_size(), check_if="critic.enable", same_as="critic.ppo_micro_batch_size_per_gpu"),
    Key(_C + "ppo_epochs", None, "Critic passes over each rollout batch; None = the actor's.", type=int,
        check=at_least(1), check_if="critic.enable", same_as="actor_rollout_ref.actor.ppo_epochs"),
    Key(_C + "shuffle", None, "Shuffle between critic epochs; None = the actor's.", type=bool,
        same_as="actor_rollout_ref.actor.shuffle"),
    Key(_C + "grad_clip", 1.0, "Clip the critic's global gradient norm (<= 0: no clipping)."),
    Key(_C + "cliprange_value", 0.5, "Value clipping range around the old values."),
    Key(_C + "loss_agg_mode", None, "Aggregation of the value loss; None = the actor's loss_agg_mode.", type=str,
        same_as="actor_rollout_ref.actor.loss_agg_mode",
        check=registered(_C + "loss_agg_mode", algos.check_loss_agg_mode)),
) + optim_keys(_C, 1e-5) + checkpoint_keys(_C, exported=False)

_R = "reward_model."
REWARD = (
    Key(_R + "enable", False, "Score responses with a reward model alone (rule-based and custom scoring are off)."),
    Key(_R + "model.path", None, "Reward model checkpoint (a *ForSequenceClassification HF directory or Hub id).",
        type=str),
    Key(_R + "model.revision", None, "Hub revision of a Hub id reward_model.model.path; None = main.", type=str),
    Key(_R + "model.input_tokenizer", None,
        "verl's policy tokenizer for the RM input: responses are always decoded with the policy's and re-tokenized "
        "with the RM's, so None or the policy's.", type=str),
    Key(_R + "micro_batch_size_per_gpu", 2, "Sequences per reward-model forward pass on each data-parallel shard.",
        check=at_least(1), check_if="reward_model.enable"),
    Key(_R + "max_length", None, "Reward-model input length; None = prompt + response length.", type=int),
    Key(_R + "reward_manager", "naive",
        "Rule-based scoring: naive (threads), prime (worker processes), batch (one call with lists), dapo (naive + "
        "overlong_buffer) or gdpo (naive; extra_info has experiment_name).", choices=REWARD_MANAGERS),
    Key(_R + "num_workers", 2, "Worker processes of the prime reward manager.", check=at_least(1)),
    Key(_R + "timeout_s", 10.0, "Seconds one scoring call may take before it scores 0 (or fails, see fail_on_error).",
        check=above(0)),
    Key(_R + "scorer_kwargs", None,
        "Options per built-in scorer, e.g. {'arithmetic': {'format_score': 0.0}}; None = their defaults.", type=object),
    Key(_R + "answer_match", "any",
        "Scorer of data sources with no scorer of their own: the response matches the ground truth exactly, "
        "as a number, by its last number, or any.", choices=ANSWER_MATCH_MODES),
    Key(_R + "fail_on_error", False, "Stop training when a scorer raises or times out; False = score 0 and count it."),
    Key(_R + "overlong_buffer.enable", False, "DAPO overlong penalty on responses near the length limit."),
    Key(_R + "overlong_buffer.len", 4, "Buffer length L_buf before the limit where the penalty ramps up."),
    Key(_R + "overlong_buffer.penalty_factor", 1.0, "Penalty at the limit (linear ramp over the buffer)."),
)

CUSTOM_REWARD = (
    Key("custom_reward_function.path", None, "Python file with a custom scoring function; None = built-in scorers.",
        type=str),
    Key("custom_reward_function.name", "compute_score", "Function name in that file."),
)

_G = "algorithm."
ALGORITHM = (
    Key(_G + "type", "rl", "What the run trains: rl (the RL loop of algorithm.adv_estimator), sft (supervised "
        "fine-tuning), dpo (prompt/chosen/rejected pairs, algorithm.dpo.*).", check=TRAINER_TYPE),
    Key(_G + "dpo.beta", 0.1, "DPO: beta, the strength of the pull towards the reference (TRL's beta; IPO's tau).",
        check=above(0)),
    Key(_G + "dpo.label_smoothing", 0.0, "DPO (sigmoid loss): the assumed fraction of flipped preference labels, "
        "in [0, 0.5) (conservative DPO; 0 = plain DPO).", check=Check(lambda v: 0 <= v < 0.5, " must be in [0, 0.5)")),
    Key(_G + "dpo.loss_type", "sigmoid", "DPO pair loss: sigmoid (DPO), hinge (SLiC) or ipo (IPO), as TRL names them.",
        choices=LOSS_TYPES),
    Key(_G + "dpo.kl_loss_coef", 0.0, "DPO: weight of a per-token KL loss to the reference added to the pair loss "
        "(the token mean over both responses of the mini-batch, Trinity-RFT's DPO); 0 = none.", check=at_least(0)),
    Key(_G + "dpo.kl_loss_type", "low_var_kl", "DPO: estimator of that KL loss (kl/k1, abs, mse/k2, low_var_kl/k3).",
        check=registered(_G + "dpo.kl_loss_type", algos.check_kl_kind)),
    Key(_G + "adv_estimator", "gae",
        "Advantage estimator: gae, grpo, rloo, reinforce, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, "
        "opo, gpg, grpo_passk, grpo_vectorized, rloo_vectorized, gdpo, or a registered name.",
        check=registered(_G + "adv_estimator", algos.check_adv_estimator)),
    Key(_G + "gdpo_reward_keys", None,
        "gdpo: reward components, keys of the dict the reward function returns; each is normalised within its "
        "group on its own.",
        type=tuple),
    Key(_G + "gdpo_reward_weights", None, "gdpo: one weight per gdpo_reward_keys entry; None = 1 each.",
        type=tuple),
    Key(_G + "gamma", 1.0, "Discount factor.", check=within(0, 1)),
    Key(_G + "lam", 1.0, "GAE lambda (bias/variance trade-off).", check=within(0, 1)),
    Key(_G + "norm_adv_by_std_in_grpo", True, "GRPO: divide by the group std; False = Dr.GRPO (mean-centred only)."),
    Key(_G + "use_kl_in_reward", False, "Subtract kl_coef * KL(actor || ref) from token rewards; loads the reference."),
    Key(_G + "kl_penalty", "kl",
        "KL estimator of the in-reward penalty: kl|k1, abs, mse|k2, low_var_kl|k3 (full is not supported).",
        check=registered(_G + "kl_penalty", algos.check_kl_kind)),
    Key(_G + "filter_groups.enable", False, "DAPO dynamic sampling: drop prompt groups whose metric does not vary and "
        "sample more prompt batches until data.train_batch_size groups remain."),
    Key(_G + "filter_groups.metric", "acc", "What must vary within a group: acc (the reward function's 'acc'), score, "
        "seq_reward (the score) or seq_final_reward (the score; no in-reward KL).",
        choices=FILTER_GROUP_METRICS),
    Key(_G + "filter_groups.max_num_gen_batches", 0,
        "Stop with an error after this many prompt batches in one step without a full batch; <= 0 = no limit."),
    Key(_G + "rollout_correction.rollout_is", None, "Off-policy correction: importance weights trainer/sampler "
        "probability per token or per sequence (product), truncated (TIS); None = off.", type=str,
        choices=IS_LEVELS),
    Key(_G + "rollout_correction.rollout_is_threshold", 2.0, "Truncation cap of the importance weights."),
    Key(_G + "rollout_correction.rollout_is_batch_normalize", False, "Divide the truncated weights by their batch "
        "mean (per token or per sequence, as rollout_is)."),
    Key(_G + "rollout_correction.rollout_rs", None, "Rejection: drop tokens (token) or responses (sequence: product "
        "of ratios; geometric: their geometric mean) whose ratio is outside the thresholds; None = off.", type=str,
        choices=RS_LEVELS),
    Key(_G + "rollout_correction.rollout_rs_threshold", None, "Upper ratio kept by rollout_rs (required with it).",
        type=float),
    Key(_G + "rollout_correction.rollout_rs_threshold_lower", None, "Lower ratio kept by rollout_rs; None = "
        "1 / rollout_rs_threshold.", type=float),
    Key(_G + "rollout_correction.rollout_token_veto_threshold", None, "Drop every response with a token whose ratio "
        "is below this; None = off.", type=float),
    Key(_G + "rollout_correction.bypass_mode", False, "The sampler's log-probs are the old policy's (no old-log-prob "
        "pass); the loss applies the correction against the current policy (docs/algorithms.md)."),
    Key(_G + "rollout_correction.loss_type", "ppo_clip", "Bypass mode's loss: ppo_clip (clipped ratio current / "
        "sampler) or reinforce (-A log pi times the rollout_is weights).", choices=BYPASS_LOSS_TYPES),
    Key(_G + "kl_ctrl.type", "fixed", "In-reward KL coefficient controller.", choices=KL_CTRL_TYPES),
    Key(_G + "kl_ctrl.kl_coef", 0.001, "(Initial) in-reward KL coefficient beta.", check=at_least(0)),
    Key(_G + "kl_ctrl.horizon", 10000, "Adaptive controller horizon."),
    Key(_G + "kl_ctrl.target_kl", 0.1, "Adaptive controller target KL."),
)

_T = "trainer."
TRAINER = (
    Key(_T + "total_epochs", 1, "Passes over the training prompts.", check=at_least(1)),
    Key(_T + "total_training_steps", None, "Stop after this many steps; None = epochs x batches per epoch.", type=int,
        check=at_least(1, " (or None)")),
    Key(_T + "project_name", "rlhf_jax", "Project name (log and checkpoint directories)."),
    Key(_T + "experiment_name", "default", "Experiment name (log and checkpoint directories)."),
    Key(_T + "logger", ("console", "tensorboard", "jsonl"),
        "Metric sinks; wandb (WANDB_MODE=offline works) and mlflow (MLFLOW_TRACKING_URI, else log_dir/mlruns) are "
        "optional packages.", choices=LOGGERS, check=TRACKERS_INSTALLED),
    Key(_T + "log_dir", "${trainer.default_local_dir}",
        "Directory of metrics.jsonl, tensorboard events and val_generations.jsonl; default: the run's directory."),
    Key(_T + "rollout_data_dir", None, "Write every step's training rollouts to <dir>/<step>.jsonl (input, output, gts, "
        "score, step: verl's dump); None = no dump.", type=str),
    Key(_T + "validation_data_dir", None, "Write every validation's generations to <dir>/<step>.jsonl (verl's dump); "
        "None = no dump.", type=str),
    Key(_T + "log_val_generations", 0, "Validation samples (prompt, response, score) logged per validation."),
    Key(_T + "default_local_dir", "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
        "Checkpoint directory (${...} refers to other keys)."),
    Key(_T + "save_freq", None, "Save a checkpoint every N steps and at the last step; <= 0 = never (verl, also on a "
        "stop signal); None = only at the last step.", type=int),
    Key(_T + "test_freq", None, "Validate every N steps and at the last step; <= 0 = never (verl); None = only at "
        "the last step.", type=int),
    Key(_T + "val_before_train", True, "Validate once before the first step of a fresh run (whatever test_freq is)."),
    Key(_T + "val_only", False, "Validate the (loaded or resumed) model once and stop without training."),
    Key(_T + "critic_warmup", 0, "Steps at the start that update only the critic."),
    Key(_T + "resume_mode", "auto",
        "auto (latest checkpoint in default_local_dir, if any), disable, or resume_path (resume_from_path).",
        choices=RESUME_MODES),
    Key(_T + "resume_from_path", None, "Checkpoint step directory to resume from when resume_mode=resume_path.",
        type=str),
    Key(_T + "max_actor_ckpt_to_keep", None, "Keep at most this many checkpoints; None = all.", type=int),
    Key(_T + "remove_previous_ckpt_in_save", False,
        "Keep only the newest checkpoint: a save removes the older ones once it is complete (max_actor_ckpt_to_keep=1)."),
    Key(_T + "max_critic_ckpt_to_keep", None, "Critic checkpoints kept: each checkpoint holds actor and critic, so only "
        "None or max_actor_ckpt_to_keep is valid.", type=int, same_as=_T + "max_actor_ckpt_to_keep"),
    Key(_T + "save_hf_checkpoint", "last",
        "Export a Hugging Face directory of the actor with the last step's checkpoint, with every checkpoint, or never.",
        choices=("last", "always", "never")),
    Key(_T + "profile_steps", None, "Steps (1-based, as logged) recorded with jax.profiler, one trace directory each "
        "under profile_dir (TensorBoard's profile tab, Perfetto); None = none.", type=tuple, check=step_numbers()),
    Key(_T + "profile_dir", "${trainer.default_local_dir}/profile", "Where the profile_steps traces are written."),
    Key(_T + "nnodes", None, "Hosts of the run (one JAX process each); must equal the number of processes. None = "
        "that number.", type=int),
    Key(_T + "n_gpus_per_node", None, "Devices used on each host, the first ones: nnodes x n_gpus_per_node devices "
        "hold the mesh (mesh.rollout_devices included). None = all.", type=int),
    Key(_T + "val_accuracy", None, "SFT: also validate by greedy generation scored like RL validation "
        "(val-core/<source>/reward); None = when every validation data source has a built-in scorer.", type=bool),
    Key(_T + "seed", 42, "Seed of new parameters (value head), sampling and every other random choice."),
    Key(_T + "env_vars", None, "Environment variables of the run, {NAME: 'value'}: set before anything reads them "
        "(the command restarts once with them) and logged; None = none (docs/formats.md).", type=object,
        check=ENV_VARS),
)

STAGES = (
    Key("stages", (), "Stages run in order: mappings of overrides (and stage_name), each from the previous stage's "
        "weights, in <default_local_dir>/stage_<i>_<name>; () = one run. One stage: --config.stages.<i>.<key>=v.",
        type=tuple),
)

KEYS: tuple[Key, ...] = CRITIC + REWARD + CUSTOM_REWARD + ALGORITHM + SHAPING + TRAINER + MESH + EXPERIENCE + STAGES
