"""Multi-process (multi-host) initialisation.

One JAX process per host (or per GPU); ``jax.distributed.initialize`` connects them
so ``jax.devices()`` lists every device of every process and one mesh spans them
all. On CPU the processes talk over gloo (e.g. several processes on 127.0.0.1 to
rehearse a multi-host run on one machine).

The launcher sets, per process:

    RLHF_JAX_COORDINATOR=host:port  RLHF_JAX_NUM_PROCESSES=N  RLHF_JAX_PROCESS_ID=i

(TPU VMs and SLURM/Open MPI clusters need none of these: ``jax.distributed.initialize()``
detects them; set ``RLHF_JAX_DISTRIBUTED=auto`` there.)

When a process dies, the others would wait in their next collective forever; the
coordination service notices the missing heartbeats instead and terminates every
other process ("Terminating process because the JAX distributed service detected
fatal errors ... another task died") after ``RLHF_JAX_HEARTBEAT_TIMEOUT_S``
seconds (default 100, JAX's; lower it to fail faster, raise it where long pauses
such as checkpoint writes to slow storage could look like a death).
"""

from __future__ import annotations

import os

import jax

ENV_COORDINATOR = "RLHF_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "RLHF_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "RLHF_JAX_PROCESS_ID"
ENV_AUTO = "RLHF_JAX_DISTRIBUTED"
ENV_HEARTBEAT = "RLHF_JAX_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 100


def heartbeat_timeout_s() -> int:
    value = os.environ.get(ENV_HEARTBEAT, str(DEFAULT_HEARTBEAT_TIMEOUT_S))
    try:
        seconds = int(value)
    except ValueError:
        seconds = 0
    if seconds < 1:
        raise ValueError(f"{ENV_HEARTBEAT}={value!r} must be a whole number of seconds >= 1")
    return seconds


def maybe_initialize() -> bool:
    """Initialise jax.distributed from the environment; False when this is a single-process run."""
    if os.environ.get(ENV_AUTO) == "auto":
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s())
        return True
    coordinator = os.environ.get(ENV_COORDINATOR)
    if not coordinator:
        return False
    try:
        num = int(os.environ[ENV_NUM_PROCESSES])
        pid = int(os.environ[ENV_PROCESS_ID])
    except (KeyError, ValueError) as e:
        raise ValueError(f"{ENV_COORDINATOR} is set, so {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be integers") from e
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num, process_id=pid,
                               heartbeat_timeout_seconds=heartbeat_timeout_s())
    return True
