"""Enough XLA:CPU threads for collectives over a mesh simulated on a CPU.

With ``--xla_force_host_platform_device_count=N`` one SPMD program runs as N participants on the CPU client's
thread pool, and an all-reduce needs all N running at once. The pool has max(cores, N) threads (``PJRT_NPROC``
replaces the core count), and a launch takes one of them and blocks it while its device already has 32
computations queued (the client's in-flight limit per device). JAX dispatches asynchronously, so a loop that gets
ahead of execution, as any loop does on a loaded machine, fills that queue: the next launch holds a thread, a
collective already started cannot seat its N participants, and after XLA's collective timeout the process aborts
("Termination timeout for `all reduce ...` ... only 7 of them arrived"). One Python thread dispatching a few
thousand 8-device all-reduces without waiting deadlocks this way on a 2-core machine every time
(tests/runtime/test_cpu_collectives.py).

Each dispatching thread blocks at most N pool threads (it waits for its own launch), so N threads per dispatching
thread plus N for the collective in flight always suffice: ``PJRT_NPROC = 8 N`` covers seven threads dispatching at
once (the trainer uses two: the loop and the overlapped sampler). Idle threads cost only their stacks' address
space; a run's speed did not change (a tiny 8-device GRPO run: 3.3 s either way). Nothing is set for one device, or
when the user set ``PJRT_NPROC``. No JAX import here: this runs before JAX's backend starts, which is when the
variable is read.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

DISPATCHING_THREADS = 7  # threads that may dispatch multi-device programs at once, covered by the pool's size
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def host_device_count(xla_flags: str) -> int:
    """The number of CPU devices ``XLA_FLAGS`` asks for (1 when it does not; the last setting wins, as in XLA)."""
    counts = _DEVICE_COUNT.findall(xla_flags or "")
    return int(counts[-1]) if counts else 1


def pool_size(devices: int) -> int:
    """Threads for ``devices`` host devices: one launch's participants per dispatching thread, plus one collective."""
    return devices * (DISPATCHING_THREADS + 1)


def ensure(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set ``PJRT_NPROC`` in ``environ`` for the CPU devices ``XLA_FLAGS`` asks for; returns the value set, or None
    (one device, a value set by the user, or a platform other than the CPU chosen)."""
    devices = host_device_count(environ.get("XLA_FLAGS", ""))
    platforms = environ.get("JAX_PLATFORMS", "")
    if devices <= 1 or "PJRT_NPROC" in environ or (platforms and "cpu" not in platforms.split(",")):
        return None
    value = str(max(os.cpu_count() or 1, pool_size(devices)))
    environ["PJRT_NPROC"] = value
    return value
