"""One process of a hand-off rehearsal (tests/parallel/test_handoff.py): processes 0 and 1 send, 2 and 3 receive,
two fake CPU devices each, over gloo on 127.0.0.1. ``python -m tests.parallel.handoff_worker SCENARIO`` with the
launcher's RLHF_JAX_* variables; prints JSON lines, and exits at once (``os._exit``) so that a peer that is gone
cannot hold it in the distributed runtime's shutdown."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

SENDERS, RECEIVERS = (0, 1), (2, 3)


def layouts():
    """name -> (shape, dtype, (mesh, spec) on the senders' devices, (mesh, spec) on the receivers'); mesh "d" is
    the group's 4 devices in a row, "rc" the same as 2 x 2."""
    from jax.sharding import PartitionSpec as P

    return {
        "same": ((8, 8), np.float32, ("d", P("d")), ("d", P("d"))),
        "rows_to_columns": ((8, 8), np.float32, ("d", P("d")), ("d", P(None, "d"))),
        "replicated_to_split": ((8, 4), np.float32, ("d", P()), ("d", P("d"))),
        "split_to_replicated": ((4, 3), np.int32, ("d", P("d")), ("d", P())),
        "grid_to_rows": ((4, 8), np.float32, ("rc", P("r", "c")), ("d", P("d"))),
        "rows_to_grid_replicas": ((8, 8), np.float32, ("d", P("d")), ("rc", P(None, "c"))),
        "scalar": ((), np.float32, ("d", P()), ("d", P())),
    }


def value(name: str, shape, dtype, step: int) -> np.ndarray:
    seed = sum(map(ord, name)) + 1000 * step
    return np.random.default_rng(seed).normal(size=shape).astype(dtype) if dtype == np.float32 else \
        np.random.default_rng(seed).integers(-99, 99, size=shape).astype(dtype)


def main() -> None:
    scenario = sys.argv[1]
    deadline = float(os.environ.get("HANDOFF_DEADLINE_S", "20"))
    from rlhf_jax.parallel.distributed import maybe_initialize

    maybe_initialize()
    import jax
    from jax.sharding import Mesh, NamedSharding

    from rlhf_jax.parallel.handoff import Channel, HandoffError

    me = jax.process_index()
    groups = {"send": [d for d in jax.devices() if d.process_index in SENDERS],
              "receive": [d for d in jax.devices() if d.process_index in RECEIVERS]}

    def meshes(devices):
        devices = sorted(devices, key=lambda d: d.id)
        return {"d": Mesh(np.array(devices), ("d",)), "rc": Mesh(np.array(devices).reshape(2, 2), ("r", "c"))}

    src_mesh, dst_mesh = meshes(groups["send"]), meshes(groups["receive"])

    def like(meshes_, side):
        return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(meshes_[where[side][0]],
                                                                                where[side][1]))
                for name, (shape, dtype, *sides) in layouts().items() for where in [dict(zip("sd", sides))]}

    src_like, dst_like = like(src_mesh, "s"), like(dst_mesh, "d")
    channel = Channel(deadline_s=deadline)
    sending = me in SENDERS
    steps = (1, 2)
    for step in steps:
        if sending:
            if scenario == "late" and step == 2:
                time.sleep(3 * deadline)  # never offers step 2 in time
                os._exit(0)
            if scenario in ("killed", "stalled") and step == 2 and me == SENDERS[-1]:
                # ready marks without the offers, then gone: the receivers' pulls from it cannot complete (process 0
                # hosts the distributed runtime's coordination service: its death ends every process at once)
                from rlhf_jax.parallel import handoff

                for r in RECEIVERS:
                    channel.client.key_value_set(f"{handoff.PREFIX}/weights/{step}/{me}->{r}",
                                                 handoff.plan_digest(handoff.transfer_plan(src_like, dst_like)))
                if scenario == "stalled":  # alive, never offering: the pulls from it hang
                    time.sleep(3 * deadline)
                    os._exit(0)
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
            tree = {name: jax.make_array_from_callback(
                        s.shape, s.sharding, lambda idx, n=name, s=s: value(n, s.shape, s.dtype, step)[idx])
                    for name, s in src_like.items()}
            channel.send("weights", step, tree, dst_like, RECEIVERS)
            channel.send_bytes("version", step, json.dumps({"version": step}).encode(), RECEIVERS)
        else:
            start = time.monotonic()
            try:
                got = channel.receive("weights", step, src_like, dst_like, SENDERS)
                meta = json.loads(channel.receive_bytes("version", step, SENDERS[0]))
            except HandoffError as e:
                print(json.dumps({"process": me, "step": step, "error": str(e),
                                  "waited_s": time.monotonic() - start}), flush=True)
                os._exit(3)
            checks = {}
            for name, arr in got.items():
                want = value(name, arr.shape, arr.dtype, step)
                checks[name] = (arr.sharding == dst_like[name].sharding
                                and all(np.array_equal(np.asarray(s.data), want[s.index])
                                        for s in arr.addressable_shards))
            print(json.dumps({"process": me, "step": step, "checks": checks, "meta": meta}), flush=True)
    channel.client.wait_at_barrier("handoff-done", 60_000)
    os._exit(0)


if __name__ == "__main__":
    main()
