"""The algorithm keys that shape scores and advantages around the estimator (ROLL's RLVR options)."""

from __future__ import annotations

from rlhf_jax import algos
from rlhf_jax.config.key import Check, Key, above

_G = "algorithm."
_FRACTION = Check(lambda v: 0.0 <= v <= 1.0, " must be in [0, 1] (a group's mean score)")

SHAPING = (
    Key(_G + "reward_norm.mean", None, "Subtract from each score the mean of its group or of the batch before the "
        "token rewards; None = none.", type=str, choices=algos.NORM_TYPES),
    Key(_G + "reward_norm.std", None, "Then divide by the (unbiased) std of the group or of the batch, plus 1e-6; "
        "None = none.", type=str, choices=algos.NORM_TYPES),
    Key(_G + "reward_clip", None, "Clip scores (after reward_norm) to [-c, c], and the token rewards again after "
        "the in-reward KL; None = off.", type=float, check=above(0)),
    Key(_G + "whiten_advantages", False, "Whiten the estimator's advantages over the batch's response tokens "
        "(mean 0, std 1); gae whitens already."),
    Key(_G + "advantage_clip", None, "Clip advantages to [-c, c] after the estimator (and the whitening); None = off.",
        type=float, check=above(0)),
    Key(_G + "sample_mask.truncated", False, "Responses that reach rollout.response_length tokens (cut at the "
        "limit) leave the loss and the advantages' statistics."),
    Key(_G + "sample_mask.difficulty", False, "Responses of groups whose mean score is not strictly between "
        "difficulty_low and difficulty_high leave the loss."),
    Key(_G + "sample_mask.difficulty_low", 0.0, "Lower bound (exclusive) of a kept group's mean score.",
        check=_FRACTION),
    Key(_G + "sample_mask.difficulty_high", 1.0, "Upper bound (exclusive) of a kept group's mean score.",
        check=_FRACTION),
)
