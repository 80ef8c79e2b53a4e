"""One process of a process-group rehearsal (tests/parallel/test_groups.py): processes 0-1 and 2-3 form two groups
that run their host collectives at the same time, each over its own processes."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    from rlhf_jax.parallel.distributed import maybe_initialize

    maybe_initialize()
    import jax
    import numpy as np

    from rlhf_jax.parallel import groups, hosts, make_mesh

    scenario = sys.argv[1]
    me = jax.process_index()
    if scenario == "split":
        training, sampling = groups.split(jax.process_count(), 2)
        groups.join(training if me in training.processes else sampling)
    group = groups.current()
    mesh = make_mesh(data=-1, fsdp=1, devices=group.devices())
    rows = np.arange(4, dtype=np.float32).reshape(2, 2) + 10 * me  # this process's rows
    batch = hosts.to_global(mesh, rows)
    out = {
        "process": me, "group": list(group.processes), "index": groups.process_index(),
        "count": groups.process_count(), "devices": groups.device_count(), "first": group.is_first,
        "gathered_values": groups.allgather(np.float32(me)).tolist(),
        "gathered_rows": hosts.gather_all(batch).tolist(),
        "local_rows_back": bool(np.array_equal(hosts.to_local(batch), rows)),
        "summed": hosts.sum_over_processes(np.array([me, 1], np.int64)).tolist(),
    }
    print(json.dumps(out), flush=True)
    jax._src.distributed.global_state.client.wait_at_barrier("groups-done", 60_000)
    os._exit(0)


if __name__ == "__main__":
    main()
