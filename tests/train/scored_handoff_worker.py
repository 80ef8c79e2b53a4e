"""One process of a split-run rehearsal of produced batches (tests/train/test_scored_handoff.py): processes 2 and 3
sample (each holds 2 prompts x 2 samples of a batch), 0 and 1 train; the batch moves from the sampling mesh to the
training mesh with each training process's rows of the prompts."""

from __future__ import annotations

import json
import os

import numpy as np

PAD = 7


def expected(step: int) -> dict:
    """The whole batch of ``step`` as numpy: 4 prompts (2 per sampling process), 2 samples each."""
    rng = np.random.default_rng(step)
    return {"rollout.prompts": rng.integers(10, 99, (8, 6)).astype(np.int32),
            "rollout.prompt_mask": np.ones((8, 6), np.int32),
            "rollout.responses": rng.integers(10, 99, (8, 5)).astype(np.int32),
            "rollout.response_mask": (rng.random((8, 5)) < 0.8).astype(np.int32),
            "rollout.logprobs": -rng.random((8, 5)).astype(np.float32),
            "rollout.finished": rng.random(8) < 0.5,
            "scores": rng.normal(size=8).astype(np.float32),
            "components": rng.normal(size=(8, 2)).astype(np.float32)}


def prompts_of(process: int, step: int):
    """Sampling process ``process``'s two prompts; process 3's are one token wider (another bucket)."""
    from rlhf_jax.types import PromptBatch

    width = 3 if process == 2 else 4
    ids = np.full((2, width), PAD, np.int32)
    ids[:, -2:] = [[process, step], [process + 10, step]]
    mask = (ids != PAD).astype(np.int32)
    return PromptBatch(input_ids=ids, attention_mask=mask, index=np.array([2 * process, 2 * process + 1]),
                       data_source=[f"src{process}"] * 2, ground_truth=[f"gt{process}a", f"gt{process}b"],
                       extra_info=[{"p": process}] * 2, raw_prompt=["a", "b"], prompt_text=["ta", "tb"], epoch=0,
                       step=step)


def main() -> None:
    from rlhf_jax.parallel.distributed import maybe_initialize

    maybe_initialize()
    import jax

    from rlhf_jax.parallel import DEFAULT_RULES, groups, hosts, make_mesh
    from rlhf_jax.parallel.handoff import Channel
    from rlhf_jax.train.scored_handoff import receive_scored, send_scored
    from rlhf_jax.types import RolloutBatch, ScoredBatch

    me = jax.process_index()
    training, sampling = groups.split(jax.process_count(), 2)
    meshes = {g.name: make_mesh(data=-1, fsdp=1, devices=g.devices()) for g in (training, sampling)}
    mine = training if me in training.processes else sampling
    groups.join(mine)
    channel = Channel(deadline_s=60)
    for step in (0, 1):
        whole = expected(step)
        if mine is sampling:
            rows = slice(4 * groups.process_index(), 4 * groups.process_index() + 4)
            arrays = {k: hosts.to_global(meshes["sampling"], v[rows]) for k, v in whole.items()}
            rollout = RolloutBatch(**{k.split(".")[1]: v for k, v in arrays.items() if k.startswith("rollout.")})
            scored = ScoredBatch(rollout=rollout, scores=arrays["scores"], baselines=None,
                                 prompts=prompts_of(me, step), version=step, data_state=f"state-{me}-{step}",
                                 metrics={"reward/mean": 0.5 + step}, components=arrays["components"])
            send_scored(channel, step, scored, meshes["training"], DEFAULT_RULES, training.processes)
            continue
        got = receive_scored(channel, step, meshes["sampling"], meshes["training"], DEFAULT_RULES,
                             sampling.processes, PAD)
        arrays = {f"rollout.{k}": getattr(got.rollout, k) for k in ("prompts", "prompt_mask", "responses",
                                                                    "response_mask", "logprobs", "finished")}
        arrays.update(scores=got.scores, components=got.components)
        train_rows = {k: v.sharding == hosts.batch_sharding(meshes["training"], v.ndim) for k, v in arrays.items()}
        equal = {k: bool(np.array_equal(hosts.gather_all(v), whole[k])) for k, v in arrays.items()}
        p = got.prompts
        print(json.dumps({"process": me, "step": step, "train_rows": train_rows, "equal": equal,
                          "prompt_ids": p.input_ids.tolist(), "mask": p.attention_mask.tolist(),
                          "ground_truth": p.ground_truth, "index": p.index.tolist(), "version": got.version,
                          "data_state": list(got.data_state), "metrics": got.metrics,
                          "baselines": got.baselines is None}), flush=True)
    jax._src.distributed.global_state.client.wait_at_barrier("scored-done", 60_000)
    os._exit(0)


if __name__ == "__main__":
    main()
