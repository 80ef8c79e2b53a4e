"""Building prompt token ids exactly as the model expects.

Three ways to turn a prompt into text (``data.prompt_template``):

- ``"native"``: the tokenizer's own chat template with ``add_generation_prompt=True``
  (a string prompt becomes one user message); the text is then tokenized without
  adding special tokens, which gives exactly
  ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``.
- ``"raw"``: the prompt text as is (a message list is joined by newlines), tokenized
  with the tokenizer's special tokens (e.g. BOS), like ``tokenizer(text)``.
- any other string: a ``str.format`` template with ``{prompt}`` (and optionally
  ``{system_prompt}``), e.g. ``"Question: {prompt}\\nAnswer:"``, tokenized like raw.

``data.system_prompt`` adds a system message (native; kept out when the messages
already start with one) or a leading line (raw / template without ``{system_prompt}``).
Prompts longer than ``data.max_prompt_length`` tokens are dropped
(``data.filter_overlong_prompts``) or handled by ``data.truncation``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlhf_jax.config.names import PROMPT_TRUNCATION
from rlhf_jax.data.records import Example, Messages
from rlhf_jax.data.sources import DataError

log = logging.getLogger(__name__)

TRUNCATION_MODES = PROMPT_TRUNCATION


def _messages_text(messages: Messages) -> str:
    return "\n".join(m["content"] for m in messages)


def chat_messages(prompt: str | Messages, system_prompt: str | None = None) -> Messages:
    """The chat messages of a prompt under the native template: a string is one user message; the system prompt
    leads unless the messages start with one."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def render_prompt(
    prompt: str | Messages,
    tokenizer: Any,
    template: str = "native",
    system_prompt: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, bool]:
    """Render one prompt to text; returns (text, add_special_tokens) for the tokenizer call.

    ``chat_template_kwargs`` reach the chat template (``native``), e.g. ``{"enable_thinking": False}``.
    """
    if template == "native":
        messages = chat_messages(prompt, system_prompt)
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                "data.prompt_template='native' needs a tokenizer with a chat template; this tokenizer has none "
                "(use 'raw' or a '{prompt}' template string)"
            )
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **(chat_template_kwargs or {}))
        return text, False
    body = prompt if isinstance(prompt, str) else _messages_text(prompt)
    if template == "raw":
        text = body
    else:
        if "{prompt}" not in template:
            raise DataError(f"data.prompt_template {template!r} must be 'native', 'raw' or contain '{{prompt}}'")
        text = template.format(prompt=body, system_prompt=system_prompt or "")
        if "{system_prompt}" in template:
            return text, True
    if system_prompt:
        text = f"{system_prompt}\n{text}"
    return text, True


def truncate_ids(ids: Sequence[int], max_length: int, mode: str, where: str = "") -> list[int]:
    """Apply data.truncation to one prompt: keep the end (left), the start (right), or both ends (middle)."""
    ids = list(ids)
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        tail = max_length - head
        return ids[:head] + (ids[-tail:] if tail else [])
    if mode == "error":
        raise DataError(
            f"{where}: prompt is {len(ids)} tokens, longer than data.max_prompt_length={max_length}; raise "
            "data.max_prompt_length, set data.truncation to left/right/middle, or data.filter_overlong_prompts=True"
        )
    raise DataError(f"data.truncation must be one of {TRUNCATION_MODES}, got {mode!r}")


def _tokenize(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    out: list[list[int]] = []
    for start in range(0, len(texts), 1024):
        enc = tokenizer(texts[start:start + 1024], add_special_tokens=add_special_tokens)
        out.extend(list(map(list, enc["input_ids"])))
    return out


def tokenize_examples(
    examples: Sequence[Example],
    tokenizer: Any,
    *,
    max_prompt_length: int,
    template: str = "native",
    system_prompt: str | None = None,
    truncation: str = "error",
    filter_overlong_prompts: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[Example], list[np.ndarray], list[str]]:
    """Render and tokenize every example up front, so bad or overlong prompts fail before training.

    Returns the kept examples, their int32 token ids and rendered prompt texts.
    """
    if truncation not in TRUNCATION_MODES:
        raise DataError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    if max_prompt_length <= 0:
        raise DataError(f"data.max_prompt_length must be positive, got {max_prompt_length}")
    rendered = [render_prompt(ex.prompt, tokenizer, template, system_prompt, chat_template_kwargs) for ex in examples]
    ids_all: list[list[int] | None] = [None] * len(rendered)
    for flag in (False, True):
        idx = [i for i, (_, special) in enumerate(rendered) if special == flag]
        if idx:
            for i, ids in zip(idx, _tokenize(tokenizer, [rendered[i][0] for i in idx], flag)):
                ids_all[i] = ids
    kept_examples, kept_ids, kept_texts = [], [], []
    n_dropped = 0
    for ex, (text, _), ids in zip(examples, rendered, ids_all):
        assert ids is not None
        if len(ids) == 0:
            raise DataError(f"{ex.where}: prompt tokenizes to zero tokens")
        if len(ids) > max_prompt_length and filter_overlong_prompts:
            n_dropped += 1
            continue
        ids = truncate_ids(ids, max_prompt_length, truncation, ex.where)
        kept_examples.append(ex)
        kept_ids.append(np.asarray(ids, dtype=np.int32))
        kept_texts.append(text)
    if n_dropped:
        log.warning(
            "data.filter_overlong_prompts: dropped %d of %d prompts longer than data.max_prompt_length=%d",
            n_dropped, len(examples), max_prompt_length,
        )
    if not kept_examples:
        raise DataError(f"every prompt is longer than data.max_prompt_length={max_prompt_length}; nothing left")
    return kept_examples, kept_ids, kept_texts


MIN_BUCKET = 16


def resolve_buckets(max_prompt_length: int, buckets: Sequence[int] | None) -> tuple[int, ...]:
    """Sorted bucket lengths ending at max_prompt_length.

    None: powers of two from 16 up to max_prompt_length (and max_prompt_length itself),
    so short prompts are not padded to the maximum while a run still compiles each
    step for only a handful of lengths.
    """
    if not buckets:
        out, b = [], MIN_BUCKET
        while b < max_prompt_length:
            out.append(b)
            b *= 2
        return tuple(out) + (int(max_prompt_length),)
    out = sorted({int(b) for b in buckets})
    if out[0] <= 0 or out[-1] > max_prompt_length:
        raise DataError(
            f"data.prompt_length_buckets {list(buckets)} must be positive and at most "
            f"data.max_prompt_length={max_prompt_length}"
        )
    if out[-1] != max_prompt_length:
        out.append(int(max_prompt_length))
    return tuple(out)


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that fits `length` tokens."""
    for b in buckets:
        if length <= b:
            return int(b)
    raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")


def pad_left(ids: Sequence[np.ndarray], length: int, pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token id rows to `length`; returns (ids int32 [B, length], attention mask int32 [B, length])."""
    out = np.full((len(ids), length), pad_token_id, dtype=np.int32)
    mask = np.zeros((len(ids), length), dtype=np.int32)
    for i, row in enumerate(ids):
        n = len(row)
        if n > length:
            raise ValueError(f"row {i} has {n} tokens, more than the padded length {length}")
        if n:
            out[i, length - n:] = row
            mask[i, length - n:] = 1
    return out, mask


def pad_token_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad id, falling back to its EOS id (as HF generation does)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise DataError("tokenizer has neither pad_token_id nor eos_token_id; cannot left-pad prompts")
    return int(pad)
