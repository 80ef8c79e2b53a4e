"""Step metrics under the names verl users know (critic/score/mean, response_length/mean, perf/throughput, ...)."""

from __future__ import annotations

import contextlib
import resource
import time
from collections import defaultdict

import jax
import numpy as np

# Dense bf16 peak FLOP/s per device for MFU; devices not listed report no MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12}


class Timer:
    """Accumulates wall time per named phase: ``with timer("gen"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


def _stats(prefix: str, values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {}
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()), f"{prefix}/min": float(values.min())}


def data_metrics(batch: dict[str, np.ndarray], *, max_prompt_length: int, max_response_length: int) -> dict[str, float]:
    """Metrics of one rollout batch (host numpy arrays, (N, R) unless noted)."""
    mask = batch["response_mask"].astype(bool)
    out = {}
    out.update(_stats("critic/score", batch["token_level_scores"].sum(-1)))
    out.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)))
    out.update(_stats("critic/advantages", batch["advantages"][mask]))
    out.update(_stats("critic/returns", batch["returns"][mask]))
    if "values" in batch:
        values, returns = batch["values"][mask], batch["returns"][mask]
        out.update(_stats("critic/values", values))
        var_returns = np.var(returns)
        out["critic/vf_explained_var"] = float(1.0 - np.var(returns - values) / (var_returns + 1e-5))
    resp_len = mask.sum(-1)
    prompt_len = batch["prompt_mask"].sum(-1)
    out.update(_stats("response_length", resp_len.astype(np.float64)))
    out["response_length/clip_ratio"] = float(np.mean(resp_len >= max_response_length))
    out.update(_stats("prompt_length", prompt_len.astype(np.float64)))
    out["prompt_length/clip_ratio"] = float(np.mean(prompt_len >= max_prompt_length))
    return out


def timing_metrics(seconds: dict[str, float], *, response_tokens: int, total_tokens: int) -> dict[str, float]:
    out = {f"timing_s/{k}": v for k, v in seconds.items()}
    for k, v in seconds.items():
        if k in ("gen",):
            out[f"timing_per_token_ms/{k}"] = 1000.0 * v / max(response_tokens, 1)
        elif k in ("ref", "values", "adv", "update_critic", "update_actor", "old_log_prob"):
            out[f"timing_per_token_ms/{k}"] = 1000.0 * v / max(total_tokens, 1)
    return out


def perf_metrics(*, total_tokens: int, step_seconds: float, update_seconds: float, num_params: int, ppo_epochs: int = 1,
                 num_devices: int | None = None) -> dict[str, float]:
    """Throughput per device, MFU of the actor update (where the device's peak is known), peak memory.
    ``num_devices``: the devices the run uses (trainer.n_gpus_per_node); None = every device."""
    n_dev = num_devices or jax.device_count()
    out = {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": step_seconds,
        "perf/throughput": total_tokens / max(step_seconds, 1e-9) / n_dev,
    }
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_FLOPS.items() if k.lower() in kind.lower()), None)
    if peak and update_seconds > 0:
        flops = 6.0 * num_params * total_tokens * ppo_epochs  # forward + backward over every token, each epoch
        out["perf/mfu/actor"] = flops / update_seconds / (peak * n_dev)
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        out["perf/max_memory_allocated_gb"] = stats["peak_bytes_in_use"] / 1024**3
    else:  # CPU: the host process's peak resident memory
        out["perf/max_memory_allocated_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    return out


def variance_proxy_metrics(old_log_probs: np.ndarray, sum_pi_squared: np.ndarray, advantages: np.ndarray,
                           mask: np.ndarray, rollout_is_weights: np.ndarray | None = None,
                           grad_norm: float | None = None) -> dict[str, float]:
    """verl's gradient-variance proxies from the score-norm proxy W = sum_t (1 - 2 pi_t + sum_v pi_v^2): the signal
    ||g||^2 (the actor's gradient norm squared), the total power E[A^2 W] (E[rho^2 A^2 W] with importance weights,
    A and rho averaged over each response), and the noise (total - signal) / (N - 1)."""
    mask = mask.astype(np.float64)
    row_mean = lambda x: (x * mask).sum(-1) / (mask.sum(-1) + 1e-8)  # noqa: E731  (verl's masked_mean)
    w = 1.0 - 2.0 * np.exp(old_log_probs) + sum_pi_squared
    a = row_mean(advantages)
    if rollout_is_weights is not None:
        w_values = (w * rollout_is_weights**2 * mask).sum(-1)
        total = float(np.mean(row_mean(rollout_is_weights) ** 2 * a**2 * np.maximum((w * mask).sum(-1), 0.0)))
    else:
        w_values = (w * mask).sum(-1)
        total = float(np.mean(a**2 * np.maximum(w_values, 0.0)))
    signal = None if grad_norm is None else float(grad_norm) ** 2
    noise = max(0.0, (total - signal) / (len(a) - 1)) if signal is not None and len(a) > 1 else 0.0
    return {"variance_proxy/proxy1_signal_strength": signal or 0.0, "variance_proxy/proxy2_total_power": total,
            "variance_proxy/proxy3_pure_noise": noise, "variance_proxy/expected_a_squared": float(np.mean(a**2)),
            "variance_proxy/expected_w": float(np.mean(w_values))}


def version_metrics(version: int, versions, step: int) -> dict[str, float]:
    """The weight versions a batch was drawn with, trained at ``step`` (updates so far): its first version and
    lag; with per-token ``versions`` (N, R) (partial rollouts; -1 where no token was drawn) also the largest
    token lag, the newest version, and the share of sequences that more than one version drew."""
    out = {"training/weight_version": float(version), "training/staleness": float(step - version)}
    if versions is None:
        return out
    drawn = versions >= 0
    newest = jax.numpy.max(jax.numpy.where(drawn, versions, -1), axis=1)
    oldest = jax.numpy.min(jax.numpy.where(drawn, versions, np.iinfo(np.int32).max), axis=1)
    sequences = jax.numpy.any(drawn, axis=1)
    mixed = jax.numpy.sum(sequences & (newest > oldest)) / jax.numpy.maximum(jax.numpy.sum(sequences), 1)
    out.update({"training/staleness_max": float(step - jax.numpy.min(jax.numpy.where(sequences, oldest, step))),
                "training/weight_version_newest": float(jax.numpy.max(newest)),
                "rollout/partial_fraction": float(mixed)})
    return out
