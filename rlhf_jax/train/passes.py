"""How each training pass lays out its batch, and the memory plan that sizes its micro-batches.

Five passes read the rollout batch: ``old_log_prob`` and ``ref`` (forward, actor and
reference), ``values`` (forward, critic), ``update_actor`` and ``update_critic``
(forward + backward). With packing (``model.use_remove_padding``) a pass runs on
micro-batches of ``rows_per_micro`` rows of ``row_len`` tokens per data-parallel
shard; ``row_len`` holds the longest possible sequence, so shapes are fixed for the
run. The micro-batch size comes from the config:

- ``use_dynamic_bsz``: a token budget (``*_max_token_len_per_gpu``) -> budget // row_len rows;
- otherwise a sequence count (``*_micro_batch_size_per_gpu``) -> the rows that many sequences of
  the longest length would fill, i.e. the same memory bound as the padded micro-batch;
- -1 in either: automatic, the largest that the memory plan fits; on CPU, gradient passes start
  from a cache-sized micro-batch instead (``CPU_GRAD_ACTIVATION_BYTES``), which is faster there.

The memory plan compiles each pass at its planned shape before the first step,
reads XLA's own estimate (``compiled.memory_analysis()``) and compares it with the
memory the device has free (host RAM on CPU). An automatic size is halved until
it fits; a size the user set that does not fit stops the run with a message that
names the keys to change.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Callable

import jax

from rlhf_jax.algos.distillation import FORWARD_KL_TOPK
from rlhf_jax.algos.rollout_correction import RolloutCorrection
from rlhf_jax.batch.packing import row_length
from rlhf_jax.parallel.backend import compile_backend
from rlhf_jax.parallel.chips import chip_of
from rlhf_jax.types import TOPK_FIELDS, TrainBatch

log = logging.getLogger(__name__)

AUTO = -1
HEADROOM = 0.85  # use at most this fraction of the free memory (XLA's estimate is not exact)

# On CPU a forward + backward runs fastest when a micro-batch's widest activation (tokens x MLP width,
# float32) stays near the cache; beyond it the backward's elementwise passes stream from memory. Measured
# on SmolLM2-135M (MLP width 1536), packed rows of 256 tokens, 2-core EPYC with 32 MiB L3, ms per token of
# forward + backward: 512 tokens 5.8, 1024 6.4, 2048 7.7, 4096 8.7 (the forward alone is flat, 1.8-1.9).
# An automatic gradient micro-batch on CPU therefore aims at this many activation bytes (512 SmolLM2
# tokens); accelerators, whose throughput grows with the batch, take the largest micro-batch that fits.
CPU_GRAD_ACTIVATION_BYTES = 3 * 2**20


def preferred_grad_tokens(mlp_width: int, backend: str) -> int | None:
    """Tokens per micro-batch an automatic gradient pass aims at on ``backend`` (None: as many as fit)."""
    if backend != "cpu":
        return None
    return max(1, CPU_GRAD_ACTIVATION_BYTES // (4 * mlp_width))


@dataclasses.dataclass(frozen=True)
class PassPlan:
    """One pass's micro-batch layout. Packed: ``rows_per_micro`` rows of ``row_len`` tokens per shard.
    Padded: ``rows_per_micro`` sequences per shard, ``seqs_per_shard // rows_per_micro`` micro-batches."""

    name: str
    packed: bool
    row_len: int  # tokens per packed row (packed passes)
    rows_per_micro: int  # packed rows (packed) or sequences (padded) per micro-batch and shard
    seqs_per_shard: int  # sequences of the (mini-)batch this pass sees on one shard
    size_keys: tuple[str, ...]  # the config keys that set this pass's micro-batch size (for messages)
    auto: bool  # the size was left automatic (-1)

    @property
    def num_micro(self) -> int:
        """Micro-batches of a padded pass."""
        return self.seqs_per_shard // self.rows_per_micro

    def smaller(self, fraction: float) -> "PassPlan | None":
        """A smaller automatic size, about ``fraction`` (< 1) of this one and at most half of it: a power of two
        of rows (packed) or a divisor of the per-shard batch (padded). None when already 1."""
        if self.rows_per_micro <= 1:
            return None
        target = max(1, min(self.rows_per_micro // 2, int(self.rows_per_micro * fraction)))
        if self.packed:
            return dataclasses.replace(self, rows_per_micro=1 << (target.bit_length() - 1))
        size = next(k for k in range(target, 0, -1) if self.seqs_per_shard % k == 0)
        return dataclasses.replace(self, rows_per_micro=size)


def _plan(name: str, *, packed: bool, dynamic: bool, budget: int, budget_key: str, micro: int, micro_key: str,
          seqs_per_shard: int, max_seq_len: int, prefer_tokens: int | None = None) -> PassPlan:
    """``prefer_tokens``: where an automatic size starts (None: the whole per-shard batch)."""
    row_len = row_length(max_seq_len)
    if not packed:  # padded: a sequence count (validated to divide the per-shard batch)
        auto = micro == AUTO
        size = micro
        if auto:
            limit = seqs_per_shard if prefer_tokens is None else max(1, prefer_tokens // max_seq_len)
            size = next(k for k in range(min(limit, seqs_per_shard), 0, -1) if seqs_per_shard % k == 0)
        return PassPlan(name, False, row_len, size, seqs_per_shard, (micro_key,), auto)
    whole = -(-seqs_per_shard * max_seq_len // row_len)  # rows that the whole per-shard batch can need
    if dynamic:
        auto = budget == AUTO
        rows = whole if auto else max(1, budget // row_len)
        keys = (budget_key,)
    else:
        auto = micro == AUTO
        rows = whole if auto else -(-micro * max_seq_len // row_len)
        keys = (micro_key,)
    if auto and prefer_tokens is not None:
        rows = min(rows, max(1, prefer_tokens // row_len))
    return PassPlan(name, packed, row_len, max(1, min(rows, whole)), seqs_per_shard, keys, auto)


def plan_passes(cfg, *, actor_mlp_width: int, critic_mlp_width: int | None = None,
                backend: str | None = None) -> dict[str, PassPlan]:
    """The layout of every pass this config runs (unpacked passes get ``packed=False``); the MLP widths of the
    actor's and critic's models and the backend (default: jax's) decide where automatic gradient passes start."""
    backend = backend or compile_backend()
    arr, critic, d = cfg.actor_rollout_ref, cfg.critic, cfg.derived
    a = "actor_rollout_ref."
    max_len = int(d.max_seq_len)
    pack = bool(arr.model.use_remove_padding)
    per_shard = int(d.rollout_batch_size_per_shard)
    plans = {
        "old_log_prob": _plan("old_log_prob", packed=pack, dynamic=arr.rollout.log_prob_use_dynamic_bsz,
                              budget=arr.rollout.log_prob_max_token_len_per_gpu,
                              budget_key=a + "rollout.log_prob_max_token_len_per_gpu",
                              micro=arr.rollout.log_prob_micro_batch_size_per_gpu,
                              micro_key=a + "rollout.log_prob_micro_batch_size_per_gpu",
                              seqs_per_shard=per_shard, max_seq_len=max_len),
        "ref": _plan("ref", packed=pack, dynamic=arr.ref.log_prob_use_dynamic_bsz,
                     budget=arr.ref.log_prob_max_token_len_per_gpu, budget_key=a + "ref.log_prob_max_token_len_per_gpu",
                     micro=arr.ref.log_prob_micro_batch_size_per_gpu,
                     micro_key=a + "ref.log_prob_micro_batch_size_per_gpu",
                     seqs_per_shard=per_shard, max_seq_len=max_len),
        "update_actor": _plan("update_actor", packed=pack, dynamic=arr.actor.use_dynamic_bsz,
                              budget=arr.actor.ppo_max_token_len_per_gpu, budget_key=a + "actor.ppo_max_token_len_per_gpu",
                              micro=arr.actor.ppo_micro_batch_size_per_gpu,
                              micro_key=a + "actor.ppo_micro_batch_size_per_gpu",
                              seqs_per_shard=int(d.actor_mini_batch_size_per_shard), max_seq_len=max_len,
                              prefer_tokens=preferred_grad_tokens(actor_mlp_width, backend)),
    }
    if critic.enable:
        c_pack = bool(critic.model.use_remove_padding)
        plans["values"] = _plan("values", packed=c_pack, dynamic=critic.use_dynamic_bsz,
                                budget=critic.forward_max_token_len_per_gpu,
                                budget_key="critic.forward_max_token_len_per_gpu",
                                micro=critic.forward_micro_batch_size_per_gpu,
                                micro_key="critic.forward_micro_batch_size_per_gpu",
                                seqs_per_shard=per_shard, max_seq_len=max_len)
        plans["update_critic"] = _plan("update_critic", packed=c_pack, dynamic=critic.use_dynamic_bsz,
                                       budget=critic.ppo_max_token_len_per_gpu,
                                       budget_key="critic.ppo_max_token_len_per_gpu",
                                       micro=critic.ppo_micro_batch_size_per_gpu,
                                       micro_key="critic.ppo_micro_batch_size_per_gpu",
                                       seqs_per_shard=int(critic.ppo_mini_batch_size * arr.rollout.n // d.dp_size),
                                       max_seq_len=max_len,
                                       prefer_tokens=preferred_grad_tokens(critic_mlp_width or actor_mlp_width, backend))
    return plans


# ---------------------------------------------------------------------------- which passes run
@dataclasses.dataclass(frozen=True)
class StepPasses:
    """Which passes an RL step runs and which per-token arrays each update reads: decided once (``step_passes``),
    read by the step and by the memory plan, so the plan compiles exactly what the step runs."""

    old_log_prob: bool  # the actor's log-probs of the batch before the update
    ref: bool  # the reference policy's log-probs
    values: str | None  # "critic": a separate value model; "actor": the value head on the actor's trunk; None
    actor_fields: tuple[str, ...]  # the per-token arrays (TrainBatch fields) the actor update reads
    sum_pi_squared: bool = False  # the old-log-prob pass also returns sum_v pi_v^2 per token (the estimator's)
    # > 0: the ref pass (the distillation teacher's) returns its top-k tokens and log-probs (N, R, k) at each
    # response position instead of the sampled tokens' log-probs (forward_kl_topk)
    teacher_topk: int = 0
    router_replay: str = "disabled"  # actor_rollout_ref.actor.router_replay.mode (which passes replay or record routes)

    critic_fields = ("values", "returns")  # the critic update's

    def runs(self, name: str) -> bool:
        return {"old_log_prob": self.old_log_prob, "ref": self.ref, "values": self.values is not None,
                "update_actor": True, "update_critic": self.values == "critic"}[name]

    def fields(self, name: str) -> tuple[str, ...]:
        """The per-token arrays pass ``name`` reads (forward passes read only the sequences)."""
        return {"update_actor": self.actor_fields, "update_critic": self.critic_fields}.get(name, ())


def step_correction(cfg, correction):
    """The rollout correction the step applies between the forward passes and the advantages: ``correction``, or
    none in bypass mode, whose loss applies it against the current policy (algos.bypass)."""
    return RolloutCorrection() if cfg.algorithm.rollout_correction.bypass_mode else correction


def step_passes(cfg, correction, *, use_kl_loss: bool) -> StepPasses:
    """The passes of a finalized config with the step's rollout ``correction`` (``step_correction``).
    The old log-probs are computed when the loss's ratio needs them (``derived.recompute_old_log_prob``), for the
    in-reward KL, for the rollout correction (which compares them with the sampler's) and for R2 routing replay
    (whose routes that pass records); never in bypass mode,
    where the sampler's are the old policy's."""
    critic = cfg.critic
    values = ("actor" if critic.shared_trunk else "critic") if critic.enable else None
    dist = cfg.distillation
    topk = int(dist.distillation_loss.topk) if dist.enabled and dist.distillation_loss.loss_mode == FORWARD_KL_TOPK \
        else 0
    reads_ref = use_kl_loss or (dist.enabled and not topk)  # the teacher's log-probs sit in ref_log_probs
    fields = ("old_log_probs", "advantages") + (("ref_log_probs",) if reads_ref else ()) + (TOPK_FIELDS if topk
                                                                                            else ()) + (
        ("rollout_is_weights",) if correction.rollout_is is not None else ()) + (
        ("values", "returns") if values == "actor" else ())
    # R2 routing replay records the routes its update replays in the old-log-prob pass (a rule refuses bypass mode)
    replay_r2 = cfg.actor_rollout_ref.actor.router_replay.mode == "R2"
    old = cfg.derived.recompute_old_log_prob or cfg.algorithm.use_kl_in_reward or correction.enabled or replay_r2
    old = old and not cfg.algorithm.rollout_correction.bypass_mode
    squares = bool(cfg.derived.sum_pi_squared)  # the old policy's, from its own pass (never in bypass mode)
    return StepPasses(old_log_prob=bool(old or squares), ref=bool(cfg.derived.need_ref), values=values,
                      actor_fields=fields, sum_pi_squared=squares, teacher_topk=topk,
                      router_replay=cfg.actor_rollout_ref.actor.router_replay.mode)


# ---------------------------------------------------------------------------- memory
def pass_batch(cfg, passes: StepPasses, name: str, packed: bool) -> TrainBatch:
    """The abstract ``TrainBatch`` pass ``name`` is compiled for: the longest prompt and response the config
    allows, the pass's rows (a mini-batch for an update), and the arrays the step gives it."""
    d, R = cfg.derived, cfg.actor_rollout_ref.rollout.response_length
    rows = {"update_actor": d.actor_mini_batch_size, "update_critic": d.critic_mini_batch_size}.get(
        name, d.rollout_batch_size)
    return TrainBatch.abstract(rows, cfg.data.max_prompt_length, R, passes.fields(name), sequences=not packed,
                               topk=passes.teacher_topk)


REPLAYING_PASSES = {"R3": ("old_log_prob", "ref", "update_actor"), "R2": ("update_actor",)}  # router_replay.mode


def compile_pass(name: str, role, plan: PassPlan, batch: TrainBatch, *, dp: int, temperature: float,
                 loss=None, sum_pi_squared: bool = False, teacher_topk: int = 0, router_replay: str = "disabled"):
    """Pass ``name`` (run by ``role``; an update trains ``loss``) compiled at its planned layout for the abstract
    ``batch`` (``pass_batch``); ``sum_pi_squared``: the old-log-prob pass also returns the squared sums;
    ``teacher_topk``: the ref pass returns the teacher's top-k (N, R, k) arrays (its outputs in the plan);
    ``router_replay``: the packed passes that replay or record MoE routes take or return them (a padded pass is
    compiled without; its routes are a few int32 per token beside the activations)."""
    rows, R = batch.response_mask.shape
    # the forward pass's extra outputs (static arguments of its program)
    extra = ({"sum_pi_squared": True} if sum_pi_squared and name == "old_log_prob" else
             {"topk": teacher_topk} if teacher_topk and name == "ref" else {})
    if plan.packed:
        # At most every packed position predicts a response token: plan for the largest logit list.
        micro_shape = (dp * plan.rows_per_micro, plan.row_len)
        logits = dp * plan.rows_per_micro * plan.row_len
        c = role.config
        routes = ((sum(c.sparse_layers), c.num_experts_per_tok) if name in REPLAYING_PASSES.get(router_replay, ())
                  else None)
        if name in ("old_log_prob", "ref"):
            record = router_replay == "R2" and name == "old_log_prob"
            return role.packed_forward_program("logp", micro_shape, logits, (rows, R), dp, routes, record,
                                               temperature=temperature, **extra)
        if name == "values":
            return role.packed_forward_program("values", micro_shape, logits, (rows, R), dp)
        return role.packed_grads_program(loss, micro_shape, logits, batch, dp, routes)
    if name in ("old_log_prob", "ref"):
        return role.padded_program("logp", batch.sequences(), n_micro=plan.num_micro, temperature=temperature,
                                   **extra)
    if name == "values":
        return role.padded_program("values", batch.sequences(), n_micro=plan.num_micro)
    return role.padded_program(loss, batch, n_micro=plan.num_micro)


def free_device_memory() -> int | None:
    """Bytes one device can still allocate: the accelerator's limit minus its use, or on CPU the host's
    available RAM shared by the local devices. None when unknown."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    if dev.platform != "cpu":  # an accelerator that reports no limit: its chip's memory less the arrays alive on it

        chip = chip_of(dev)
        if chip is None:
            return None
        used = sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards if s.device == dev)
        return chip.usable_bytes(dev.platform) - used
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"] // jax.local_device_count()
    except (OSError, KeyError, ValueError):
        return None


def _memory_analysis(compiled):
    """XLA's memory analysis of a compiled program, or None where the backend gives none."""
    try:
        return compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement it
        return None


def compiled_bytes(compiled) -> int | None:
    """XLA's estimate of the memory a compiled step allocates per device beyond its (donated) inputs."""
    ma = _memory_analysis(compiled)
    if ma is None:
        return None
    return int(ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)


def per_device_bytes(tree, host: bool = False) -> int:
    """Bytes one device holds of the (real or abstract) arrays of ``tree``: each array's shard, summed; arrays in
    host memory (offloaded parameters and optimizer state) hold none. ``host``: the bytes of each device's shards
    that are kept in host memory instead."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape, sharding = getattr(leaf, "shape", None), getattr(leaf, "sharding", None)
        if shape is None or (getattr(sharding, "memory_kind", None) in ("pinned_host", "unpinned_host")) != host:
            continue
        shard = sharding.shard_shape(shape) if sharding is not None else shape
        count = 1
        for n in shard:
            count *= n
        total += count * leaf.dtype.itemsize
    return total


def held_bytes(role, name: str) -> int:
    """Per-device bytes of the resident arrays (parameters) the pass ``name`` takes as arguments."""
    return per_device_bytes([role.params, role.frozen] if name.startswith("update") else role.state())


def pass_bytes(compiled, held: int) -> int | None:
    """What a compiled pass adds on a device beyond the run's resident arrays: its other arguments (the micro-batch,
    the gradient accumulator), its outputs and temporaries; ``held``: the resident arguments' bytes (``held_bytes``).
    None when XLA gives no memory analysis."""
    ma = _memory_analysis(compiled)
    if ma is None:
        return None
    return int(ma.argument_size_in_bytes - held + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)


def gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"


def fit_pass(plan: PassPlan, compile_at: Callable[[PassPlan], object], free: int | None, hint: str,
             need_of: Callable[[object], int | None] = compiled_bytes) -> tuple[PassPlan, int | None]:
    """The plan (automatic sizes halved until they fit) and its estimated bytes (``need_of`` the compiled pass);
    raises when a set size does not fit."""
    while True:
        need = compiled_need(lambda: compile_at(plan), need_of, free)
        if free is None or need is None or need <= HEADROOM * free:
            return plan, need
        # Activation memory grows about linearly with the micro-batch: aim straight at the size that fits.
        smaller = plan.smaller(HEADROOM * free / need) if plan.auto else None
        if smaller is not None:
            log.info("memory plan: %s at %s needs %s > %s usable; trying a smaller micro-batch", plan.name,
                     describe(plan), gib(need), gib(HEADROOM * free))
            plan = smaller
            continue
        error = MemoryError(
            f"the {plan.name} pass needs about {gib(need)} per device (XLA's estimate for micro-batches of "
            f"{describe(plan)} per shard), more than the {gib(HEADROOM * free)} usable of {gib(free)} free: lower "
            f"{' / '.join(plan.size_keys)} (or set it to -1 to size it automatically), {hint}")
        error.plan = plan  # the last size tried
        raise error


def refused_bytes(error: BaseException) -> int | None:
    """The bytes a compiler's out-of-memory refusal names (XLA:TPU: "the total memory required for HLO temporaries
    (96.99G) exceeds available HBM (95.74G)"); None when ``error`` is not such a refusal."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text.split("\n", 1)[0]:
        return None
    found = re.search(r"required for [^(]*\(([\d.]+)([KMGT]?)\)", text)
    if not found:
        return 0
    return int(float(found.group(1)) * 1024 ** " KMGT".index(found.group(2) or " "))


def compiled_need(compile_it: Callable[[], object], need_of: Callable[[object], int | None],
                  free: int | None) -> int | None:
    """``need_of`` the compiled program; a compiler that refuses the program for want of memory (XLA:TPU checks the
    chip's memory while compiling) counts as needing what it names, at least more than ``free``."""
    try:
        return need_of(compile_it())
    except Exception as e:  # noqa: BLE001 - only an out-of-memory refusal is handled
        named = refused_bytes(e)
        if named is None:
            raise
        return max(named, (free or 0) + 1)


def describe(plan: PassPlan) -> str:
    if plan.packed:
        return f"{plan.rows_per_micro} packed rows x {plan.row_len} tokens"
    return f"{plan.rows_per_micro} sequences"
