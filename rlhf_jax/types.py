"""The hand-offs of one RL step, in the order the step makes them:

``PromptBatch`` (the loader) -> ``RolloutBatch`` (the sampler) -> ``ScoredBatch`` (rewards: one produced batch
waiting to be trained on) -> ``TrainBatch`` (the update's inputs: the sequences and every per-token array the
losses read).

They are frozen ``flax.struct`` dataclasses: array fields are pytree leaves (a ``TrainBatch`` goes through
``jax.jit`` as it is), host metadata is static. Every stage imports them from here; this module imports nothing
else of the package, so any layer can.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

Messages = list[dict[str, str]]  # a chat: [{"role": ..., "content": ...}, ...]


@struct.dataclass
class PromptBatch:
    """One batch of prompts (this process's share): left-padded ids plus per-row metadata for rewards and logs."""

    input_ids: np.ndarray  # int32 [B, L], L a bucket length, left padded
    attention_mask: np.ndarray  # int32 [B, L], 1 on real prompt tokens
    index: np.ndarray  # int64 [B], row numbers in the PromptDataset
    data_source: list[str] = struct.field(pytree_node=False)
    ground_truth: list[Any] = struct.field(pytree_node=False)
    extra_info: list[dict[str, Any]] = struct.field(pytree_node=False)
    raw_prompt: list[str | Messages] = struct.field(pytree_node=False)  # the prompt as in the data (text or chat)
    prompt_text: list[str] = struct.field(pytree_node=False)  # the rendered prompt text that was tokenized
    epoch: int = struct.field(pytree_node=False)
    step: int = struct.field(pytree_node=False)  # global batch number since the start of training (0-based)
    # int32 [B]: each row's domain (its position in data.domain_weights) when sampling by domain, else None
    domain: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@struct.dataclass
class RolloutBatch:
    """Sampled responses, N = B * n rows in prompt-major order; all arrays sharded over the batch."""

    prompts: jax.Array  # (N, P) int32, left-padded with the pad id
    prompt_mask: jax.Array  # (N, P) int32
    responses: jax.Array  # (N, R) int32, pad id after the end
    response_mask: jax.Array  # (N, R) int32: the trained tokens (single-turn: 1 up to and including EOS, 0 after)
    logprobs: jax.Array  # (N, R) float32: log_softmax(logits / temperature) of each sampled token, 0 where masked
    finished: jax.Array  # (N,) bool: the response ended with an EOS token (not cut at R)
    # (N, R) int32: the response tokens in the sequence, contiguous from column 0, where they differ from the
    # trained ones (multi-turn: tool responses are in the sequence, response_mask 0); None: response_mask
    response_valid: jax.Array | None = None
    # (N, P + R, sparse layers, K) int32: the expert ids the sampler routed each prompt and fed-back response token
    # to (router_replay.mode R3); -1 where no token was routed (padding, the last token). None: not recorded.
    routed_experts: jax.Array | None = None
    # (N, R) int32: the weight version (updates applied) that drew each response token, -1 where none was drawn;
    # None: one version drew the whole batch (``ScoredBatch.version``). Set by partial rollouts (rollout/segments.py).
    versions: jax.Array | None = None

    def valid_mask(self) -> jax.Array:
        """(N, R) the response tokens the model reads (the attention mask's response part)."""
        return self.response_mask if self.response_valid is None else self.response_valid

    def input_ids(self) -> jax.Array:
        """Prompt and response side by side (N, P + R): the sequence a trainer scores."""
        return jnp.concatenate([self.prompts, self.responses], axis=1)

    def attention_mask(self) -> jax.Array:
        return jnp.concatenate([self.prompt_mask, self.valid_mask()], axis=1)

    def response_lengths(self) -> jax.Array:
        return jnp.sum(self.valid_mask(), axis=1)


# RolloutBatch's arrays every rollout has, and those some carry (None otherwise): what a copy of a batch keeps
ROLLOUT_ARRAYS = ("prompts", "prompt_mask", "responses", "response_mask", "logprobs", "finished")
ROLLOUT_OPTIONAL = ("response_valid", "versions", "routed_experts")


@struct.dataclass
class ScoredBatch:
    """One rollout batch with its rewards, waiting to be trained on (the experience buffer holds these)."""

    rollout: RolloutBatch  # on the training mesh
    scores: jax.Array  # (N,) float32, global; (N, R) token-level rewards with multi_turn.per_turn_rewards
    baselines: jax.Array | None  # ReMax's greedy baseline scores (N,), or None
    prompts: PromptBatch = struct.field(pytree_node=False)  # the process-local prompts it was sampled from
    version: int = struct.field(pytree_node=False)  # updates applied to the weights that sampled it
    data_state: Any = struct.field(pytree_node=False)  # the loader's state before its prompts were drawn
    metrics: dict[str, float] = struct.field(pytree_node=False)  # reward metrics and production timings
    components: jax.Array | None = None  # GDPO's reward components (N, K) (algorithm.gdpo_reward_keys), or None
    # prompt batches drawn from the loader for it: more than one when dynamic sampling (algorithm.filter_groups)
    # sampled further batches to fill it
    draws: int = struct.field(pytree_node=False, default=1)


TOPK_FIELDS = ("teacher_topk_ids", "teacher_topk_log_probs")  # TrainBatch's (N, R, k) fields


@struct.dataclass
class TrainBatch:
    """What an update (or a forward pass) reads: global (N, ...) arrays sharded over the batch axes.

    ``input_ids`` / ``attention_mask`` (N, P + R): left-padded prompt followed by the response; ``responses`` /
    ``response_mask`` (N, R), the mask marking the trained tokens. The per-token arrays (N, R) are present where
    the run computes them (None otherwise, so a step's program has exactly the inputs it reads). A packed pass
    leaves out the sequences: its packed micro-batches carry the tokens, the batch the (N, R) grid.
    """

    input_ids: jax.Array | None = None
    attention_mask: jax.Array | None = None
    responses: jax.Array | None = None
    response_mask: jax.Array | None = None
    old_log_probs: jax.Array | None = None
    ref_log_probs: jax.Array | None = None
    values: jax.Array | None = None
    advantages: jax.Array | None = None
    returns: jax.Array | None = None
    rollout_is_weights: jax.Array | None = None
    sum_pi_squared: jax.Array | None = None  # sum_v pi_v^2 per token under the old policy (optimal token baseline)
    # (N, P + R, sparse layers, K) int32 expert ids a MoE forward pass replays (router_replay; -1: route natively),
    # aligned with input_ids: a model input like the sequences
    routed_experts: jax.Array | None = None
    # (N, R, k): the distillation teacher's k most probable tokens at each response position (int32) and their
    # log-probs (float32), forward_kl_topk's
    teacher_topk_ids: jax.Array | None = None
    teacher_topk_log_probs: jax.Array | None = None

    def sequences(self) -> TrainBatch:
        """Only the model's inputs (what a forward pass reads)."""
        return TrainBatch(input_ids=self.input_ids, attention_mask=self.attention_mask, responses=self.responses,
                          routed_experts=self.routed_experts)

    def only(self, per_token: tuple[str, ...]) -> TrainBatch:
        """The sequences, the response mask and the ``per_token`` fields; every other field None."""
        return TrainBatch(input_ids=self.input_ids, attention_mask=self.attention_mask, responses=self.responses,
                          response_mask=self.response_mask, routed_experts=self.routed_experts,
                          **{f: getattr(self, f) for f in per_token})

    def grid(self) -> TrainBatch:
        """The batch without its sequences: the per-token grid a packed pass reads next to its micro-batches."""
        return self.replace(input_ids=None, attention_mask=None, responses=None, routed_experts=None)

    @staticmethod
    def abstract(rows: int, prompt_width: int, response_width: int, per_token: tuple[str, ...],
                 sequences: bool = True, topk: int = 0) -> TrainBatch:
        """A batch of ``jax.ShapeDtypeStruct`` (what a program is compiled for; the program places it): ``rows``
        sequences of ``prompt_width`` + ``response_width`` tokens with the ``per_token`` fields (float32; the
        teacher's top-k fields (rows, response_width, ``topk``)), or with ``sequences=False`` only the response
        grid (a packed pass's)."""
        spec = jax.ShapeDtypeStruct

        width = prompt_width + response_width
        fields = {f: spec((rows, response_width) + ((topk,) if f in TOPK_FIELDS else ()),
                          jnp.int32 if f == "teacher_topk_ids" else jnp.float32) for f in per_token}
        if sequences:
            fields.update(input_ids=spec((rows, width), jnp.int32), attention_mask=spec((rows, width), jnp.int32),
                          responses=spec((rows, response_width), jnp.int32))
        return TrainBatch(response_mask=spec((rows, response_width), jnp.int32), **fields)


def shape_key(tree: Any) -> tuple:
    """A hashable description of a pytree's structure and leaf shapes (a compile cache key)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
