"""Pure-function RL algorithm core: advantages, KL, policy/value losses, entropy, aggregation.

Imports nothing from the rest of rlhf_jax. All functions take (batch, length)
arrays (group ids: (batch,)), take strings as static arguments and work under
``jax.jit``. Names are registered so a config string picks them and users can
add their own with ``register_adv_estimator`` / ``register_policy_loss`` /
``register_kl_estimator``.
"""

from .advantages import check_adv_estimator, compute_advantages, dense_group_index, group_stats
from .aggregation import (
    LOSS_AGG_MODES,
    agg_loss,
    check_loss_agg_mode,
    loss_denominator,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from .entropy import entropy_from_logits, map_sequence_chunks, token_log_probs, token_log_probs_and_entropy
from .kl import (
    apply_kl_in_reward,
    check_kl_kind,
    full_kl_from_logits,
    init_kl_controller,
    kl_loss,
    kl_penalty,
    update_kl_controller,
)
from .policy_losses import check_policy_loss, effective_loss_agg_mode, policy_loss
from .bypass import BYPASS_LOSS_TYPES  # registers the bypass_mode loss
from .distillation import FORWARD_KL_TOPK, DistillSpec, distillation_loss, forward_kl_topk
from . import optimal_baseline  # noqa: F401  (registers the optimal-token-baseline estimators)
from .registry import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    EstimatorInfo,
    POLICY_LOSSES,
    Registry,
    estimator_info,
    register_adv_estimator,
    register_kl_estimator,
    register_policy_loss,
)
from .shaping import NORM_TYPES, clip_symmetric, normalize_scores, sample_mask, whiten_by_segment
from .value_loss import value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "EstimatorInfo",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "NORM_TYPES",
    "POLICY_LOSSES",
    "Registry",
    "agg_loss",
    "apply_kl_in_reward",
    "check_adv_estimator",
    "clip_symmetric",
    "check_kl_kind",
    "check_loss_agg_mode",
    "check_policy_loss",
    "DistillSpec",
    "distillation_loss",
    "FORWARD_KL_TOPK",
    "forward_kl_topk",
    "compute_advantages",
    "dense_group_index",
    "effective_loss_agg_mode",
    "entropy_from_logits",
    "estimator_info",
    "full_kl_from_logits",
    "group_stats",
    "init_kl_controller",
    "kl_loss",
    "kl_penalty",
    "loss_denominator",
    "map_sequence_chunks",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_scores",
    "policy_loss",
    "register_adv_estimator",
    "register_kl_estimator",
    "register_policy_loss",
    "sample_mask",
    "token_log_probs",
    "token_log_probs_and_entropy",
    "update_kl_controller",
    "value_loss",
    "whiten_by_segment",
]
