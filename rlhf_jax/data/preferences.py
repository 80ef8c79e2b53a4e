"""Preference data for DPO: a prompt with a chosen and a rejected response, tokenized up front.

A row holds the prompt (``data.prompt_key``; recognised by name when unset, as for RL prompts) and two
responses (``data.chosen_key`` / ``data.rejected_key``, Trinity-RFT's and TRL's ``chosen`` / ``rejected``),
each a string or a list of chat messages (the assistant turn(s) that follow the prompt).

The prompt is rendered and tokenized exactly as for RL (:mod:`rlhf_jax.data.prompts`), so a model sees the
tokens it would be sampled from. A response is tokenized on its own, as the continuation of that prompt:

- ``prompt_template=native``: the chat template renders prompt + response (a string response is one
  assistant message); the response is the text after the rendered prompt (it carries the template's
  end-of-turn tokens, as TRL's conversational data does);
- ``raw`` or a ``{prompt}`` template: the response text followed by the tokenizer's EOS token (TRL appends
  EOS to plain-text completions too).

A response longer than ``data.max_response_length`` tokens keeps its start when ``data.truncation`` is not
``error`` (the start is what the prompt conditions); under ``error`` it stops the run naming file and row.
Every problem is found here, before any model loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlhf_jax.data.loader import PromptDataset, media_keys
from rlhf_jax.data.prompts import chat_messages, tokenize_examples
from rlhf_jax.data.records import Example, Messages, to_example
from rlhf_jax.data.sources import DataError, Row, get_path, read_files


@dataclasses.dataclass
class PreferenceDataset:
    """Tokenized preference pairs; ``prompts`` (the rows the grain loader walks) is parallel to the responses."""

    prompts: PromptDataset
    chosen: list[np.ndarray]  # int32 token ids of each row's chosen response
    rejected: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.prompts)

    def longest(self) -> tuple[int, int]:
        """(longest prompt, longest response) in tokens."""
        return (max(len(x) for x in self.prompts.input_ids),
                max(len(x) for x in self.chosen + self.rejected))


def parse_response(value: Any, where: str, key: str) -> str | Messages:
    """A response cell: a string, or a non-empty list of messages with string role and content."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value:
        for j, msg in enumerate(value):
            if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
                raise DataError(f"{where}: column {key!r} message {j} must be an object with string 'role' and "
                                f"'content', got {msg!r:.120}")
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"{where}: column {key!r} must be a string or a non-empty list of chat messages, "
                    f"got {type(value).__name__}")


def response_text(prompt: str | Messages, prompt_text: str, response: str | Messages, tokenizer: Any, *,
                  template: str, system_prompt: str | None, chat_template_kwargs: dict | None, where: str,
                  key: str) -> tuple[str, bool]:
    """The text of ``response`` as the continuation of the rendered ``prompt_text``, and whether the tokenizer's
    EOS token must follow it (plain-text templates)."""
    if template != "native":
        return (response if isinstance(response, str) else "\n".join(m["content"] for m in response)), True
    turns = [{"role": "assistant", "content": response}] if isinstance(response, str) else response
    full = tokenizer.apply_chat_template(chat_messages(prompt, system_prompt) + turns, tokenize=False,
                                         **(chat_template_kwargs or {}))
    if not full.startswith(prompt_text):
        raise DataError(f"{where}: the chat template does not render prompt + {key!r} as a continuation of the "
                        "prompt it renders for generation, so the response's tokens are undefined; use "
                        "data.prompt_template=raw or a data.chat_template that does")
    return full[len(prompt_text):], False


def _response_ids(text: str, add_eos: bool, tokenizer: Any, *, max_length: int, truncation: str, where: str,
                  key: str) -> np.ndarray:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if add_eos and eos is not None and (not ids or ids[-1] != eos):
        ids.append(int(eos))
    if not ids:
        raise DataError(f"{where}: column {key!r} tokenizes to zero tokens")
    if len(ids) > max_length:
        if truncation == "error":
            raise DataError(f"{where}: column {key!r} is {len(ids)} tokens, longer than data.max_response_length="
                            f"{max_length}; raise data.max_response_length, or set data.truncation to left/right/"
                            "middle (responses keep their first tokens)")
        ids = ids[:max_length]
    return np.asarray(ids, np.int32)


def _response_cells(row: Row, chosen_key: str, rejected_key: str) -> tuple[Any, Any]:
    cells = []
    for key, name in ((chosen_key, "data.chosen_key"), (rejected_key, "data.rejected_key")):
        try:
            cells.append(get_path(row.data, key))
        except KeyError:
            raise DataError(f"{row.where}: missing column {key!r} ({name}); a preference row needs a prompt, a "
                            f"chosen and a rejected response; row has columns {sorted(row.data)}") from None
    return cells[0], cells[1]


def build_preference_dataset(
    files: str | Sequence[str],
    tokenizer: Any,
    *,
    split: str | None = None,
    prompt_key: str | None = None,
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    max_prompt_length: int = 512,
    max_response_length: int = 512,
    prompt_template: str = "native",
    system_prompt: str | None = None,
    truncation: str = "error",
    filter_overlong_prompts: bool = False,
    max_samples: int = -1,
    sample_seed: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    media_keys: Sequence[str] = ("images", "videos"),
    max_length: int | None = None,
) -> PreferenceDataset:
    """Read, check and tokenize every pair of ``files`` (a missing or malformed column names its file and row).

    ``max_length``: the most tokens of prompt + response; a longer pair is dropped with ``filter_overlong_prompts``
    (as ROLL's DPO pipeline drops it), else refused naming its row."""
    rows = read_files(files, split)
    cells = [_response_cells(row, chosen_key, rejected_key) for row in rows]  # every row checked before any work
    if 0 < max_samples < len(rows):
        keep = (np.arange(max_samples) if sample_seed is None
                else np.sort(np.random.default_rng(sample_seed).choice(len(rows), max_samples, replace=False)))
        rows, cells = [rows[i] for i in keep], [cells[i] for i in keep]
    examples: list[Example] = []
    responses: dict[int, tuple[Any, Any]] = {}
    for row, (chosen, rejected) in zip(rows, cells):
        ex = to_example(row, prompt_key, "", "preferences", media_keys)
        responses[id(ex)] = (parse_response(chosen, row.where, chosen_key),
                             parse_response(rejected, row.where, rejected_key))
        examples.append(ex)
    kept, prompt_ids, texts = tokenize_examples(
        examples, tokenizer, max_prompt_length=max_prompt_length, template=prompt_template,
        system_prompt=system_prompt, truncation=truncation, filter_overlong_prompts=filter_overlong_prompts,
        chat_template_kwargs=chat_template_kwargs)
    out: dict[str, list[np.ndarray]] = {"chosen": [], "rejected": []}
    fits: list[int] = []
    for i, (ex, text) in enumerate(zip(kept, texts)):
        pair = []
        for key, response in ((chosen_key, responses[id(ex)][0]), (rejected_key, responses[id(ex)][1])):
            body, add_eos = response_text(ex.prompt, text, response, tokenizer, template=prompt_template,
                                          system_prompt=system_prompt, chat_template_kwargs=chat_template_kwargs,
                                          where=ex.where, key=key)
            pair.append((body, add_eos, key))
        if max_length is not None:
            full = max(len(_response_ids(b, e, tokenizer, max_length=1 << 30, truncation="error", where=ex.where,
                                         key=k)) for b, e, k in pair)
            if len(prompt_ids[i]) + full > max_length:
                if filter_overlong_prompts:
                    continue
                raise DataError(f"{ex.where}: prompt + response is {len(prompt_ids[i]) + full} tokens, more than "
                                f"data.max_length={max_length}; raise it, or set data.filter_overlong_prompts=True "
                                "to drop such pairs")
        fits.append(i)
        for which, (body, add_eos, key) in zip(("chosen", "rejected"), pair):
            out[which].append(_response_ids(body, add_eos, tokenizer, max_length=max_response_length,
                                            truncation=truncation, where=ex.where, key=key))
    if not fits:
        raise DataError(f"{files}: no preference pair is within data.max_length={max_length} tokens")
    prompts = PromptDataset([kept[i] for i in fits], [prompt_ids[i] for i in fits], [texts[i] for i in fits])
    return PreferenceDataset(prompts, out["chosen"], out["rejected"])


def preference_dataset_from_config(data_cfg: Any, tokenizer: Any, which: str = "train") -> PreferenceDataset:
    """The train or val preference pairs of the ``data`` section of a config."""
    d = data_cfg
    files = d[f"{which}_files"]
    if not files:
        raise DataError(f"data.{which}_files is not set")
    return build_preference_dataset(
        list(files) if not isinstance(files, str) else files, tokenizer,
        split=d[f"{which}_split"],
        prompt_key=d.prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
        max_prompt_length=int(d.max_prompt_length),
        max_response_length=int(d.max_response_length),
        prompt_template=d.prompt_template,
        system_prompt=d.system_prompt or None,
        truncation=d.truncation,
        filter_overlong_prompts=bool(d.filter_overlong_prompts),
        max_samples=int(d[f"{which}_max_samples"]),
        chat_template_kwargs=dict(d.apply_chat_template_kwargs or {}),
        media_keys=media_keys(d),
        sample_seed=int(d.seed) if which == "train" and d.shuffle else None,
        max_length=None if d.max_length is None else int(d.max_length),
    )
