"""Peak memory of one collective over 8 fake CPU devices, against XLA's own figures.

``python benchmarks/collective_memory.py psum 256`` runs one all-reduce (``psum``), all-gather (``gather``: each
device contributes an eighth of its block) or local op (``scale``) on 256 MiB per device, and prints the process's
peak resident set before and after the step with XLA's temporary and output sizes per device. It checks whether
XLA:CPU's in-process collectives allocate beyond the program's buffer assignment (see "Context parallelism" in
benchmarks/README.md: the context-8 cells' excess).
"""

from __future__ import annotations

import json
import os
import resource
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

BODIES = {
    "scale": lambda a, n: a * 2,
    "psum": lambda a, n: jax.lax.psum(a, "c"),
    "gather": lambda a, n: jax.lax.all_gather(a[:, : n // 8], "c", tiled=True),
}


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    kind, mib = sys.argv[1], int(sys.argv[2])
    mesh = Mesh(np.array(jax.devices()), ("c",))
    n = mib * 2**20 // 4  # float32s per device
    rows = NamedSharding(mesh, P("c"))
    x = jax.jit(lambda: jnp.ones((8, n), jnp.float32), out_shardings=rows)()  # made on each device, never whole
    jax.block_until_ready(x)
    body = BODIES[kind]
    step = jax.jit(jax.shard_map(lambda a: body(a, n), mesh=mesh, in_specs=P("c"), out_specs=P("c")))
    compiled = step.lower(x).compile()
    memory = compiled.memory_analysis()
    before = peak_mib()
    jax.block_until_ready(compiled(x))
    print(json.dumps({"kind": kind, "MiB_per_device": mib, "peak_before_step_MiB": round(before),
                      "peak_MiB": round(peak_mib()), "xla_temp_MiB_per_device": memory.temp_size_in_bytes / 2**20,
                      "xla_out_MiB_per_device": memory.output_size_in_bytes / 2**20}))


if __name__ == "__main__":
    main()
