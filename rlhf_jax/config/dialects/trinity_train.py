"""Trinity-RFT's ``mode: train`` (the trainer alone, on a dataset) and its dataset fields, for trinity.py.

``mode: train`` with ``algorithm_type: sft`` or ``dpo`` trains from ``buffer.trainer_input.experience_buffer``,
a file or Hugging Face dataset (``path``, ``subset_name``, ``split``) read through its ``format``: plaintext rows
(prompt_key / response_key, or chosen_key / rejected_key) or chat messages (messages_key; the loss on the last
assistant message unless ``enable_concatenated_multi_turn``). These become our SFT and DPO trainers' data keys.
Trinity's DPO adds a KL loss to the reference (k2 where the file names none) and reads ``beta`` and
``label_smoothing`` from ``policy_loss_fn_args``; each experience row is one pair.
"""

from __future__ import annotations

import os
import re
from typing import Any

from rlhf_jax.config import hub_data
from rlhf_jax.config.dialects.rules import get

A = "actor_rollout_ref."
TRAIN_ALGORITHMS = ("sft", "dpo")
EXPERIENCE = "buffer.trainer_input.experience_buffer"
_DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".arrow")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def training_only(full: dict) -> bool:
    """Whether the file runs Trinity's trainer alone (mode: train)."""
    return get(full, "mode") == "train"


def algorithm(full: dict) -> Any:
    return get(full, "algorithm.algorithm_type")


def mode(value: Any, full: dict) -> dict:
    """both: sampling and training alternate in one program; train: the SFT or DPO trainer on a dataset."""
    if value == "both":
        if algorithm(full) in TRAIN_ALGORITHMS:
            raise ValueError(f"algorithm_type {algorithm(full)} trains from a dataset: use mode: train")
        return {}
    if value != "train":
        raise ValueError("use both (explore and train) or train (sft / dpo from a dataset); explore, bench and "
                         "serve run no training")
    if algorithm(full) not in TRAIN_ALGORITHMS:
        raise ValueError(f"with algorithm.algorithm_type={algorithm(full)!r}: mode train runs sft or dpo here")
    out = {"algorithm.type": algorithm(full), "data.val_files": ()}  # Trinity evaluates in the explorer only
    if algorithm(full) == "dpo":
        out[A + "model.use_remove_padding"] = False  # the DPO trainer runs padded pairs
    return out


def dataset(path: Any, subset: Any, where: str) -> str:
    """A Trinity dataset path (load_dataset's: a local file or directory, else a Hub id) with its subset, as a
    data.*_files entry."""
    path = str(path)
    if os.path.exists(os.path.expanduser(path)):
        if subset is not None:
            raise ValueError(f"{where}.subset_name={subset!r}: {path!r} is a local path; a subset names a "
                             "configuration of a Hub dataset")
        return path
    hub = _HUB_ID.match(path) and not path.lower().endswith(_DATA_SUFFIXES)
    if hub:
        return hub_data.spec(path, None if subset is None else str(subset))
    if subset is not None:
        raise ValueError(f"{where}.subset_name={subset!r}: {path!r} is neither a local path nor a Hub dataset id "
                         "(org/name)")
    return path  # a missing local file: finalize names it


def train_batch(value: Any, full: dict) -> dict:
    """buffer.train_batch_size: in mode train the rows (SFT examples, DPO pairs) per optimizer step."""
    size = int(value)
    out = {"data.train_batch_size": size}
    if algorithm(full) == "dpo":
        out[A + "actor.ppo_mini_batch_size"] = size
    return out


_FORMAT_KEYS = ("prompt_type", "prompt_key", "response_key", "messages_key", "chosen_key", "rejected_key",
                "system_prompt", "system_prompt_key", "tools_key", "enable_concatenated_multi_turn", "chat_template",
                "image_key", "video_key", "reply_prefix", "workflow_key", "reward_fn_key")
_IGNORED = ("name", "enable_progress_bar", "max_retry_times", "max_retry_interval", "capacity", "max_read_timeout",
            "index")


def _format(fmt: dict, where: str) -> tuple[dict, str]:
    """The experience buffer's format as our SFT / DPO data keys (Trinity's FormatConfig defaults)."""
    unknown = sorted(set(fmt) - set(_FORMAT_KEYS))
    if unknown:
        raise ValueError(f"{where}.format.{unknown[0]} has no rlhf_jax equivalent")
    for key in ("system_prompt_key", "image_key", "video_key", "reply_prefix"):
        if fmt.get(key):
            raise ValueError(f"{where}.format.{key}={fmt[key]!r} is not supported by rlhf_jax (put the system prompt "
                             "in format.system_prompt; text rows only)")
    for key in ("workflow_key", "reward_fn_key"):
        if fmt.get(key):
            raise ValueError(f"{where}.format.{key}={fmt[key]!r}: per-row workflows and reward functions apply to "
                             "tasksets, not to SFT / DPO data")
    if fmt.get("tools_key") not in (None, "tools"):
        raise ValueError(f"{where}.format.tools_key={fmt['tools_key']!r} is not supported by rlhf_jax (tool schemas "
                         "from rows do not reach the chat template)")
    kind = str(fmt.get("prompt_type", "messages"))
    if kind not in ("messages", "plaintext"):
        raise ValueError(f"{where}.format.prompt_type={kind!r}: use messages or plaintext")
    out: dict[str, Any] = {"data.chosen_key": str(fmt.get("chosen_key", "chosen")),
                           "data.rejected_key": str(fmt.get("rejected_key", "rejected"))}
    if fmt.get("chat_template"):
        out["data.chat_template"] = str(fmt["chat_template"])
    if kind == "plaintext":
        out["data.prompt_key"] = str(fmt.get("prompt_key", "prompt"))
        if fmt.get("system_prompt"):
            out["data.system_prompt"] = str(fmt["system_prompt"])
    return out, kind


def experience_buffer(value: Any, full: dict) -> dict:
    """mode both: experiences pass from sampler to update in memory (replay is refused); mode train: the SFT /
    DPO dataset (path, subset_name, split, format)."""
    value = value if isinstance(value, dict) else {}
    where = EXPERIENCE
    if not training_only(full):
        replay = value.get("replay_buffer")
        if isinstance(replay, dict) and replay.get("enable"):
            raise ValueError(f"{where}.replay_buffer: experience replay is not implemented")
        return {}
    storage = value.get("storage_type", "file")
    if storage != "file":
        raise ValueError(f"{where}.storage_type={storage!r}: mode train reads a file or Hub dataset (file)")
    if not value.get("path"):
        raise ValueError(f"{where}.path is required in mode train (the SFT / DPO dataset)")
    unknown = sorted(set(value) - set(_IGNORED) - {"storage_type", "path", "subset_name", "split", "format",
                                                  "replay_buffer", "schema_type"})
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} has no rlhf_jax equivalent")
    out, kind = _format(dict(value.get("format") or {}), where)
    out.update({"data.train_files": (dataset(value["path"], value.get("subset_name"), where),),
                "data.train_split": str(value.get("split", "train"))})
    fmt = dict(value.get("format") or {})
    if algorithm(full) == "sft":
        del out["data.chosen_key"], out["data.rejected_key"]
        if kind == "messages":
            out.update({"data.multiturn.enable": True, "data.multiturn.messages_key": str(fmt.get("messages_key",
                                                                                                    "message")),
                        "data.multiturn.train_on": "all" if fmt.get("enable_concatenated_multi_turn") else "last"})
        else:
            out["data.response_key"] = str(fmt.get("response_key", "response"))
    elif kind == "messages":  # DPO: the prompt is a message list, chosen / rejected the assistant's messages
        out["data.prompt_key"] = str(fmt.get("messages_key", "message"))
    return out


def dpo_loss(policy_loss: Any, full: dict) -> dict:
    """policy_loss_fn dpo: beta and label_smoothing from policy_loss_fn_args (Trinity's defaults 0.1, 0)."""
    if policy_loss not in ("default", "dpo"):
        raise ValueError("algorithm_type dpo trains with policy_loss_fn dpo")
    args = dict(get(full, "algorithm.policy_loss_fn_args") or {})
    unknown = sorted(set(args) - {"beta", "label_smoothing"})
    if unknown:
        raise ValueError(f"policy_loss_fn_args.{unknown[0]} has no rlhf_jax equivalent for dpo")
    return {"algorithm.dpo.beta": float(args.get("beta", 0.1)),
            "algorithm.dpo.label_smoothing": float(args.get("label_smoothing", 0.0))}


def sft_loss(policy_loss: Any, full: dict) -> dict:
    """policy_loss_fn sft: the token mean of the response tokens' negative log-likelihood."""
    if policy_loss not in ("default", "sft"):
        raise ValueError("algorithm_type sft trains with policy_loss_fn sft")
    args = dict(get(full, "algorithm.policy_loss_fn_args") or {})
    if not args.get("use_token_level_loss", True) or set(args) - {"use_token_level_loss"}:
        raise ValueError("policy_loss_fn_args: the SFT loss here is the token mean (use_token_level_loss: true)")
    return {}
