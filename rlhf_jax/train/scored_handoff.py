"""Produced batches from the sampling processes to the training processes of a split run (parallel/groups.py).

A ``ScoredBatch`` is device arrays sharded over the sampling mesh's batch axes (the rollout, the scores, ReMax's
baselines, GDPO's components) plus host values held per process (its rows of the prompts, the loader's state, the
reward metrics). The arrays go device to device through ``parallel/handoff.Channel`` into the training mesh's
batch layout; each sampling process sends its host part to every training process, which puts the prompts of the
whole batch together and keeps its own rows (the rows of the training mesh's batch sharding that it holds). The
array shapes change from batch to batch (response lengths), so the first sampling process sends them first.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Sequence

import jax
import numpy as np

from rlhf_jax.parallel import batch_sharding, groups
from rlhf_jax.parallel.handoff import Channel
from rlhf_jax.types import PromptBatch, RolloutBatch, ScoredBatch

NAME = "scored"


def _arrays(scored: ScoredBatch) -> dict[str, Any]:
    """The device arrays of a produced batch (absent ones left out)."""
    fields = {f"rollout.{f.name}": getattr(scored.rollout, f.name) for f in dataclasses.fields(scored.rollout)
              if getattr(scored.rollout, f.name) is not None}
    fields.update({k: getattr(scored, k) for k in ("scores", "baselines", "components")
                   if getattr(scored, k) is not None})
    return fields


def _laid_out(shapes: dict[str, tuple], mesh, rules) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=batch_sharding(mesh, len(shape), rules))
            for k, (shape, dtype) in shapes.items()}


def send_scored(channel: Channel, step: int, scored: ScoredBatch, train_mesh, rules,
                receivers: Sequence[int]) -> None:
    """Offer batch ``step`` (0-based) to the training processes ``receivers``, who hold it on ``train_mesh``."""
    arrays = _arrays(scored)
    shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in arrays.items()}
    if groups.current().is_first:
        channel.send_bytes(f"{NAME}.shapes", step, pickle.dumps(shapes), receivers)
    host = {"prompts": scored.prompts, "version": scored.version, "data_state": scored.data_state,
            "metrics": scored.metrics, "draws": scored.draws}
    channel.send_bytes(f"{NAME}.host", step, pickle.dumps(host), receivers)
    channel.send(NAME, step, arrays, _laid_out(shapes, train_mesh, rules), receivers)


def receive_scored(channel: Channel, step: int, sampling_mesh, train_mesh, rules, senders: Sequence[int],
                   pad_token_id: int) -> ScoredBatch:
    """Batch ``step`` from the sampling processes ``senders``, laid out over ``train_mesh`` with this process's
    rows of the prompts; ``data_state`` is the tuple of every sampling process's loader state (in process order)."""
    shapes = pickle.loads(channel.receive_bytes(f"{NAME}.shapes", step, senders[0]))
    hosts = [pickle.loads(channel.receive_bytes(f"{NAME}.host", step, s)) for s in senders]
    arrays = channel.receive(NAME, step, _laid_out(shapes, sampling_mesh, rules), _laid_out(shapes, train_mesh, rules),
                             senders)
    rollout = RolloutBatch(**{k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("rollout.")})
    prompts = joined_prompts([h["prompts"] for h in hosts], pad_token_id)
    metrics = {k: v for h in hosts[:1] for k, v in h["metrics"].items()}
    return ScoredBatch(rollout=rollout, scores=arrays["scores"], baselines=arrays.get("baselines"),
                       prompts=sliced_prompts(prompts, *own_rows(len(prompts))), version=hosts[0]["version"],
                       data_state=tuple(h["data_state"] for h in hosts), metrics=metrics,
                       components=arrays.get("components"), draws=int(hosts[0]["draws"]))


def own_rows(count: int) -> tuple[int, int]:
    """[start, stop) of the rows of a batch of ``count`` that this process holds: its group's processes hold
    consecutive blocks in order (as ``hosts.to_global`` assembles a batch)."""
    per = count // groups.process_count()
    return groups.process_index() * per, (groups.process_index() + 1) * per


def joined_prompts(parts: Sequence[PromptBatch], pad_token_id: int) -> PromptBatch:
    """The prompt rows of several processes, in order, as one batch (left-padded with ``pad_token_id`` to the
    widest part's bucket)."""
    width = max(p.input_ids.shape[1] for p in parts)

    def padded(x: np.ndarray, value: int) -> np.ndarray:
        return np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=value)

    first = parts[0]
    return PromptBatch(
        input_ids=np.concatenate([padded(p.input_ids, pad_token_id) for p in parts]),
        attention_mask=np.concatenate([padded(p.attention_mask, 0) for p in parts]),
        index=np.concatenate([p.index for p in parts]),
        data_source=[x for p in parts for x in p.data_source], ground_truth=[x for p in parts for x in p.ground_truth],
        extra_info=[x for p in parts for x in p.extra_info], raw_prompt=[x for p in parts for x in p.raw_prompt],
        prompt_text=[x for p in parts for x in p.prompt_text], epoch=first.epoch, step=first.step,
        domain=None if first.domain is None else np.concatenate([p.domain for p in parts]))


def sliced_prompts(pb: PromptBatch, start: int, stop: int) -> PromptBatch:
    """Rows [start, stop) of a prompt batch."""
    cut = slice(start, stop)
    return PromptBatch(input_ids=pb.input_ids[cut], attention_mask=pb.attention_mask[cut], index=pb.index[cut],
                       data_source=pb.data_source[cut], ground_truth=pb.ground_truth[cut],
                       extra_info=pb.extra_info[cut], raw_prompt=pb.raw_prompt[cut], prompt_text=pb.prompt_text[cut],
                       epoch=pb.epoch, step=pb.step, domain=None if pb.domain is None else pb.domain[cut])
