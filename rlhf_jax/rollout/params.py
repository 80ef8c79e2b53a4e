"""Sampling settings: the ``actor_rollout_ref.rollout`` keys (and their ``val_kwargs``) as one frozen dataclass.

A ``SamplingParams`` is hashable and, except for ``seed``, part of the
compiled sampler's identity: every field but the seed is baked into the
program as a constant (greedy vs sampled, which processors run, ``top_k`` as a
static size). A training run uses two settings (train and validation), so the
sampler compiles a bounded number of times.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable

DEFAULT_PROCESSORS = ("temperature", "top_k", "top_p")
_ROLLOUT = "actor_rollout_ref.rollout"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample responses (names follow verl's rollout keys).

    ``temperature == 0`` or ``do_sample=False`` means greedy decoding. ``top_k`` of
    -1 or 0 and ``top_p == 1`` switch those filters off. ``max_new_tokens`` is
    verl's ``response_length``; ``min_new_tokens`` keeps EOS from being drawn before that many tokens
    (HF's ``min_new_tokens``, vLLM's ``min_tokens``). ``processors`` names the registered logit
    processors applied in order before a token is drawn. ``max_num_seqs`` caps
    the number of decode slots (sequences decoded at once); None lets the
    sampler choose it from the batch (see ``scheduler.num_slots``).
    """

    max_new_tokens: int
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1
    do_sample: bool = True
    ignore_eos: bool = False
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    processors: tuple[str, ...] = DEFAULT_PROCESSORS
    max_num_seqs: int | None = None
    # Mixture-of-Experts routing replay (router_replay.mode R3): also return every token's expert ids
    record_routes: bool = False

    def __post_init__(self):
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        object.__setattr__(self, "processors", tuple(self.processors))
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"{_ROLLOUT}.response_length (max_new_tokens) must be >= 1, got {self.max_new_tokens}")
        if not 0 <= int(self.min_new_tokens) <= int(self.max_new_tokens):
            raise ValueError(f"{_ROLLOUT}.min_new_tokens must be in [0, response_length={self.max_new_tokens}], "
                             f"got {self.min_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"{_ROLLOUT}.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{_ROLLOUT}.top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < -1:
            raise ValueError(f"{_ROLLOUT}.top_k must be an integer >= -1 (-1 or 0 = off), got {self.top_k}")
        if int(self.n) < 1:
            raise ValueError(f"{_ROLLOUT}.n must be >= 1, got {self.n}")
        if self.max_num_seqs is not None:
            object.__setattr__(self, "max_num_seqs", int(self.max_num_seqs))
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"{_ROLLOUT}.max_num_seqs must be >= 1 or None (from the batch), got {self.max_num_seqs}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: ``do_sample`` is off or the temperature is 0."""
        return (not self.do_sample) or self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the distribution whose log-probs are reported (1 when the temperature is 0)."""
        return self.temperature if self.temperature > 0 else 1.0

    def static_key(self) -> "SamplingParams":
        """These settings without the seed: what a compiled sampler depends on."""
        return dataclasses.replace(self, seed=0)

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_config(
        cls,
        rollout: Any,
        *,
        validation: bool = False,
        eos_token_ids: Iterable[int] = (),
        pad_token_id: int = 0,
    ) -> "SamplingParams":
        """Build from the ``actor_rollout_ref.rollout`` section of a finalized config (every default filled there).

        ``validation=True`` takes temperature/top_k/top_p/n/do_sample from ``val_kwargs``.
        """
        source = rollout.val_kwargs if validation else rollout
        return cls(
            max_new_tokens=int(rollout.response_length),
            min_new_tokens=int(rollout.min_new_tokens),
            temperature=float(source.temperature),
            top_k=int(source.top_k),
            top_p=float(source.top_p),
            n=int(source.n),
            do_sample=bool(source.do_sample),
            ignore_eos=bool(rollout.ignore_eos),
            seed=int(rollout.seed),
            eos_token_ids=tuple(eos_token_ids),
            pad_token_id=int(pad_token_id),
            max_num_seqs=rollout.max_num_seqs,
        )


def as_token_ids(value: Any) -> list[int]:
    """An ``eos_token_id`` entry (None, an int or a list) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def eos_token_ids_from_dir(model_dir: str, tokenizer: Any = None) -> tuple[int, ...]:
    """Every EOS id a checkpoint declares: the tokenizer's, config.json's and generation_config.json's.

    Generation stops at any of them (chat models often end turns with a token
    other than the tokenizer's EOS, listed only in generation_config.json).
    """
    ids: list[int] = []
    if tokenizer is not None:
        ids += as_token_ids(getattr(tokenizer, "eos_token_id", None))
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                ids += as_token_ids(json.load(f).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))
