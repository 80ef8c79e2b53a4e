"""The ``distillation`` section (verl's names): on-policy distillation from a teacher model.

The student (the actor) samples; a frozen teacher scores the sampled tokens; the per-token divergence between the
two is trained either as a loss (its gradient) or as a reward (its negative as the policy gradient's advantage).
"""

from __future__ import annotations

from rlhf_jax.config.key import Key, above, at_least

_D = "distillation."
_L = _D + "distillation_loss."
# verl's single-sample estimators of the divergence (algos.kl's names)
DISTILLATION_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# the forward KL over the teacher's top-k tokens (algos.distillation.FORWARD_KL_TOPK)
DISTILLATION_LOSS_MODES = DISTILLATION_ESTIMATORS + ("forward_kl_topk",)

KEYS: tuple[Key, ...] = (
    Key(_D + "enabled", False, "On-policy distillation: the teacher's log-probs of the student's samples take the "
        "reference's place (its pass, its memory) and give the distillation loss."),
    Key(_D + "teacher_models.teacher_model.model_path", None, "The teacher: a Hugging Face directory or Hub id with "
        "the student's tokenizer (its vocabulary must cover the student's token ids).", type=str),
    Key(_L + "loss_mode", "k3", "Per-token divergence student vs teacher: kl (k1), abs, mse (k2), low_var_kl (k3) "
        "of the sampled token (verl's estimators), or forward_kl_topk over the teacher's top-k tokens."),
    Key(_L + "topk", 32, "Teacher tokens per position of forward_kl_topk: its pass returns their ids and log-probs "
        "(unused by the estimators).", check=at_least(1)),
    Key(_L + "use_task_rewards", True, "Also train the task's policy loss; false: the distillation loss alone "
        "(the task's rewards and advantages are still computed and logged)."),
    Key(_L + "distillation_loss_coef", 1.0, "Weight of the distillation loss beside the task's policy loss (1 "
        "without task rewards).", check=at_least(0)),
    Key(_L + "loss_max_clamp", None, "Clamp each token's divergence to [-c, c]; None = no clamp.", type=float,
        check=above(0)),
    Key(_L + "log_prob_min_clamp", None, "forward_kl_topk: both models' top-k log-probs are clamped below at this "
        "value before the KL sum; None = no clamp (unused by the estimators).", type=float),
    Key(_L + "use_policy_gradient", False, "The negative divergence is each token's advantage of a PPO-clip loss "
        "(Thinking Machines' on-policy distillation); false: the divergence is the loss."),
    Key(_L + "policy_loss_mode", "vanilla", "The policy loss of use_policy_gradient (verl: vanilla only).",
        choices=("vanilla",)),
    Key(_L + "clip_ratio", 0.2, "PPO clip of use_policy_gradient; default of clip_ratio_low / high.", check=above(0)),
    Key(_L + "clip_ratio_low", None, "Lower PPO clip of use_policy_gradient; None = clip_ratio.", type=float,
        check=above(0), same_as=_L + "clip_ratio"),
    Key(_L + "clip_ratio_high", None, "Upper PPO clip of use_policy_gradient; None = clip_ratio.", type=float,
        check=above(0), same_as=_L + "clip_ratio"),
)
