"""The tokens that follow an assistant turn with tool calls: the tool responses as the model's chat template renders
them, up to the start of the next assistant turn.

Only the new suffix of the rendered conversation is appended (the conversation so far stays as sampled, token for
token). The suffix is what the template writes after an assistant message's content when tool messages and the
generation prompt follow it; it is found by rendering a placeholder assistant message. When the model's turn ended
with its EOS token, the suffix's leading EOS text (the template's end of the assistant message) is already in
the conversation and is dropped.
"""

from __future__ import annotations

from typing import Any, Sequence

_PLACEHOLDER = "@@assistant-content@@"
_BEFORE = [{"role": "user", "content": "?"}]


def tool_suffix_text(tokenizer: Any, tool_messages: Sequence[dict], ended_with_eos: bool) -> str:
    messages = _BEFORE + [{"role": "assistant", "content": _PLACEHOLDER}] + list(tool_messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(_PLACEHOLDER) != 1:
        raise ValueError("the chat template does not render an assistant message's content verbatim; "
                         "multi-turn rollouts need one that does")
    suffix = text[text.index(_PLACEHOLDER) + len(_PLACEHOLDER):]
    eos = tokenizer.eos_token
    if ended_with_eos and eos and suffix.startswith(eos):
        suffix = suffix[len(eos):]
    return suffix


def tool_suffix_ids(tokenizer: Any, tool_messages: Sequence[dict], ended_with_eos: bool) -> list[int]:
    """Token ids of ``tool_suffix_text`` (no special tokens added: the template's own are in the text)."""
    return list(tokenizer.encode(tool_suffix_text(tokenizer, tool_messages, ended_with_eos), add_special_tokens=False))
