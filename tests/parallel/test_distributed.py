"""Several processes: when one dies, the others stop with an error within a bounded time instead of hanging.

Two real processes joined by ``rlhf_jax.parallel.distributed.maybe_initialize`` (gloo on 127.0.0.1) run a
collective every 0.2 s; one is killed with SIGKILL; the survivor must exit non-zero, saying another task
died, well within 60 s (heartbeat timeout 5 s here).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rlhf_jax.parallel.distributed import ENV_HEARTBEAT, heartbeat_timeout_s
from tests.parallel.rehearsal import free_port
from tests.train.helpers import REPO

WORKER = """
import time
import numpy as np
import jax
from rlhf_jax.parallel.distributed import maybe_initialize
assert maybe_initialize()
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("d",))
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
x = jax.make_array_from_callback((len(jax.devices()),), NamedSharding(mesh, P("d")), lambda i: np.ones((1,), np.float32))
for step in range(100000):
    assert float(total(x)) == len(jax.devices())
    print("step", step, flush=True)
    time.sleep(0.2)
"""


@pytest.mark.parametrize("victim", [1, 0], ids=["worker dies", "coordinator dies"])
def test_the_survivor_exits_with_an_error_when_another_process_dies(tmp_path, victim):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs, logs = [], []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   PYTHONPATH=REPO, RLHF_JAX_COORDINATOR=f"127.0.0.1:{port}", RLHF_JAX_NUM_PROCESSES="2",
                   RLHF_JAX_PROCESS_ID=str(pid), **{ENV_HEARTBEAT: "5"})
        logs.append(open(tmp_path / f"p{pid}.log", "w+"))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"p{i}.log").read_text().count("step ") >= 3 for i in range(2)):
            assert time.monotonic() < deadline, "the two processes never ran collectives together"
            assert all(p.poll() is None for p in procs), [(tmp_path / f"p{i}.log").read_text()[-2000:] for i in range(2)]
            time.sleep(0.5)
        procs[victim].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        survivor = procs[1 - victim]
        code = survivor.wait(timeout=60)  # raises (and fails the test) if it hangs
        waited = time.monotonic() - killed_at
        output = (tmp_path / f"p{1 - victim}.log").read_text()
        assert code != 0
        assert "another task died" in output, output[-3000:]
        print(f"survivor exited {code} after {waited:.1f} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def test_heartbeat_timeout_must_be_a_positive_whole_number(monkeypatch):
    monkeypatch.setenv(ENV_HEARTBEAT, "7")
    assert heartbeat_timeout_s() == 7
    for bad in ("0", "-3", "fast"):
        monkeypatch.setenv(ENV_HEARTBEAT, bad)
        with pytest.raises(ValueError, match=ENV_HEARTBEAT):
            heartbeat_timeout_s()
