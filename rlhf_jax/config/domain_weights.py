"""The check of ``data.domain_weights`` (sampling training prompts by domain), shared by the key table and the
loader (rlhf_jax.data.domains)."""

from __future__ import annotations

import math
from typing import Any

WEIGHT_SUM_TOLERANCE = 1e-6


def weights_problem(weights: Any) -> str | None:
    """Why ``data.domain_weights`` is unusable, or None (None or empty: no sampling by domain). The weights need
    not sum to 1: the last domain's share is what the others leave (ROLL's ``domain_interleave_probs``)."""
    if not weights:
        return None
    if not hasattr(weights, "items"):
        return f"data.domain_weights={weights!r} must be a mapping {{domain: weight}}"
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            return f"data.domain_weights.{name}={w!r} must be a number >= 0"
    # ROLL's rule, not normalised: every domain but the last takes int(w x batch), the last the rest of the batch
    before_last = sum(float(w) for w in list(weights.values())[:-1])
    if before_last > 1.0 + WEIGHT_SUM_TOLERANCE:
        return (f"data.domain_weights: the weights before the last domain sum to {before_last:g}, more than the "
                "whole batch (the last domain takes the rest)")
    return None
