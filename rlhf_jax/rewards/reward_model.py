"""Scoring responses with a sequence-score reward model (an HF ``*ForSequenceClassification`` directory).

The reward model has its own tokenizer and chat template. When they differ from
the policy's, the response is decoded with the policy tokenizer and the
conversation is re-rendered with the RM's template: the prompt messages (a string
prompt becomes one user message) plus ``{"role": "assistant", "content":
response}``, without a generation prompt. An RM tokenizer without a chat template
gets ``prompt text + response`` with its special tokens. Inputs longer than
``reward_model.max_length`` keep their last tokens (the response end matters most).

Forward passes are jitted and run in micro-batches of ``micro_batch_size`` rows
per data-parallel shard (verl's ``micro_batch_size_per_gpu``): on a mesh each
micro-batch is split over the batch axes, as the policy's passes are. Rows are
left padded to a power-of-two length bucket (with several processes, to
``max_length``, the same everywhere), so each (micro-batch, bucket) compiles
once. The score is label ``label_index`` (0) of the model output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rlhf_jax.parallel import groups
from flax import nnx

Messages = list[dict[str, str]]


def _bucket(length: int, cap: int | None) -> int:
    b = 16
    while b < length:
        b *= 2
    return min(b, cap) if cap else b


def decode_responses(tokenizer: Any, response_ids: np.ndarray, response_mask: np.ndarray) -> list[str]:
    """Decode each row's valid response tokens with the policy tokenizer (special tokens skipped)."""
    ids = np.asarray(response_ids)
    mask = np.asarray(response_mask).astype(bool)
    return [tokenizer.decode(ids[b][mask[b]].tolist(), skip_special_tokens=True) for b in range(ids.shape[0])]


class RewardModelScorer:
    """A jitted, micro-batched sequence-score model plus the tokenizer that formats its inputs."""

    def __init__(
        self,
        model: nnx.Module,
        tokenizer: Any,
        *,
        micro_batch_size: int = 8,
        max_length: int | None = None,
        label_index: int = 0,
        mesh: Any = None,
        rules: Any = None,
    ):
        if micro_batch_size <= 0:
            raise ValueError(f"reward_model.micro_batch_size_per_gpu must be positive, got {micro_batch_size}")
        from rlhf_jax.parallel import DEFAULT_RULES, batch_sharding, data_parallel_size

        self.tokenizer = tokenizer
        # Rows of one forward pass on this process: micro_batch_size per data-parallel shard it holds.
        shards = data_parallel_size(mesh) // groups.process_count() if mesh is not None else 1
        self.micro_batch_size = int(micro_batch_size) * max(shards, 1)
        self.row_sharding = batch_sharding(mesh, 2, rules or DEFAULT_RULES) if mesh is not None else None
        self.max_length = max_length
        self.label_index = int(label_index)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else (getattr(tokenizer, "eos_token_id", None) or 0))
        graphdef, self._state = nnx.split(model)

        def forward(state: Any, ids: jax.Array, mask: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, state)(ids, mask)[:, self.label_index]

        self._forward = jax.jit(forward)

    @classmethod
    def from_pretrained(
        cls, path: str, *, tokenizer_path: str | None = None, mesh: Any = None, rules: Any = None,
        dtype: Any = jnp.float32, **kwargs: Any
    ) -> RewardModelScorer:
        """Load the RM weights with rlhf_jax.models and its tokenizer (from `tokenizer_path` or the RM directory)."""
        from transformers import AutoTokenizer

        from rlhf_jax.models import from_pretrained

        model = from_pretrained(path, mesh=mesh, dtype=dtype, **({"rules": rules} if rules else {}))
        return cls(model, AutoTokenizer.from_pretrained(tokenizer_path or path), mesh=mesh, rules=rules, **kwargs)

    @classmethod
    def from_config(cls, reward_cfg: Any, mesh: Any = None, dtype: Any = jnp.float32,
                    rules: Any = None) -> RewardModelScorer:
        """From a finalized config's `reward_model`: model.path (and revision), micro_batch_size_per_gpu,
        max_length."""
        from rlhf_jax.models.hub import resolve_model_path

        path = reward_cfg.model.path
        if not path:
            raise ValueError("reward_model.enable is set but reward_model.model.path is empty")
        return cls.from_pretrained(
            resolve_model_path(path, reward_cfg.model.revision), mesh=mesh, rules=rules, dtype=dtype,
            micro_batch_size=int(reward_cfg.micro_batch_size_per_gpu), max_length=reward_cfg.max_length,
        )

    def encode(self, prompts: Sequence[str | Messages], responses: Sequence[str]) -> list[list[int]]:
        """RM token ids for each (prompt, decoded response) pair, per the module docstring."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        tok = self.tokenizer
        out = []
        for prompt, response in zip(prompts, responses):
            if getattr(tok, "chat_template", None) is not None:
                messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
                text = tok.apply_chat_template(messages + [{"role": "assistant", "content": response}],
                                               tokenize=False)
                ids = tok(text, add_special_tokens=False)["input_ids"]
            else:
                prompt_text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
                ids = tok(prompt_text + response)["input_ids"]
            ids = list(ids)
            if self.max_length and len(ids) > self.max_length:
                ids = ids[-self.max_length:]
            out.append(ids)
        return out

    def score_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Scores (float32 [B]) of left-padded token rows, in jitted micro-batches."""
        ids = np.asarray(input_ids, dtype=np.int32)
        mask = np.asarray(attention_mask, dtype=np.int32)
        B, T = ids.shape
        mb = self.micro_batch_size
        n_pad = (-B) % mb
        if n_pad:  # filler rows: one real token each, scores discarded
            ids = np.concatenate([ids, np.full((n_pad, T), self.pad_token_id, np.int32)])
            filler = np.zeros((n_pad, T), np.int32)
            filler[:, -1] = 1
            mask = np.concatenate([mask, filler])
        scores = [self._local(self._forward(self._state, self._place(ids[s:s + mb]), self._place(mask[s:s + mb])))
                  for s in range(0, len(ids), mb)]
        return np.concatenate(scores)[:B].astype(np.float32)

    def _place(self, rows: np.ndarray) -> Any:
        """This process's rows of one micro-batch, as a global array split over the mesh's batch axes."""
        if self.row_sharding is None:
            return rows
        if groups.process_count() == 1:
            return jax.device_put(rows, self.row_sharding)
        return jax.make_array_from_process_local_data(self.row_sharding, rows)

    @staticmethod
    def _local(scores: jax.Array) -> np.ndarray:
        """This process's scores of a batch-split global array, in row order."""
        if scores.is_fully_addressable:
            return np.asarray(scores)
        pieces = {(s.index[0].start or 0): np.asarray(s.data) for s in scores.addressable_shards}
        return np.concatenate([pieces[k] for k in sorted(pieces)])

    def score_texts(self, prompts: Sequence[str | Messages], responses: Sequence[str]) -> np.ndarray:
        """Scores (float32 [B]) of decoded responses to their prompts, formatted with the RM's template."""
        rows = self.encode(prompts, responses)
        longest = self.max_length if groups.process_count() > 1 and self.max_length else max(len(r) for r in rows)
        length = _bucket(longest, self.max_length)
        ids = np.full((len(rows), length), self.pad_token_id, np.int32)
        mask = np.zeros((len(rows), length), np.int32)
        for i, r in enumerate(rows):
            ids[i, length - len(r):] = r
            mask[i, length - len(r):] = 1
        return self.score_ids(ids, mask)
