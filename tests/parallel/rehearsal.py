"""Four local JAX processes (two fake CPU devices each) over gloo on 127.0.0.1, running one module of tests/parallel
as ``python -m MODULE SCENARIO``; their JSON lines come back per process."""

from __future__ import annotations

import json
import os
import socket
import time

from tests.train.helpers import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rehearse(module: str, scenario: str, *, watch: tuple[int, ...] = (0, 1, 2, 3), env: dict | None = None,
             timeout: float = 120) -> tuple[dict[int, list[dict]], float]:
    """Each watched process's JSON lines, and the seconds until the watched processes had exited (the others are
    killed then)."""
    import tempfile

    from tests.cli_zygote import popen_module

    port, files = free_port(), tempfile.mkdtemp(prefix="rlhf_jax-test-rehearsal-")
    procs = []
    for i in range(4):  # forked from the tests' pre-imported interpreter where the environment allows
        penv = dict(os.environ, RLHF_JAX_COORDINATOR=f"127.0.0.1:{port}", RLHF_JAX_NUM_PROCESSES="4",
                    RLHF_JAX_PROCESS_ID=str(i), JAX_PLATFORMS="cpu",
                    XLA_FLAGS="--xla_force_host_platform_device_count=2", **(env or {}))
        procs.append(popen_module(module, [scenario], env=penv, cwd=REPO, stdout=os.path.join(files, f"{i}.out")))
    start = time.monotonic()
    try:
        outs = {i: procs[i].communicate(timeout=timeout)[0] for i in watch}
        done = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return {i: [json.loads(line) for line in out.splitlines() if line.startswith("{")] for i, out in outs.items()}, done
