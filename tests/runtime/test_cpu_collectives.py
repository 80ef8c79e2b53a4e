"""A mesh simulated on CPU devices: collectives dispatched faster than they run deadlock XLA:CPU's thread pool unless
it has threads to spare (rlhf_jax/runtime/cpu_collectives.py), which the package's entry points give it."""

from __future__ import annotations

import os
import subprocess
import sys

from rlhf_jax.runtime import cpu_collectives

# One thread dispatching 3000 8-device all-reduces without waiting: the queue of each device passes the client's
# in-flight limit within the first hundreds.
LOOP = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
mesh = Mesh(np.array(jax.devices()), ("x",))
x = jax.device_put(jnp.ones((8, 64), jnp.float32), NamedSharding(mesh, PartitionSpec("x")))
total = jax.jit(lambda a: a.sum(0) + 1.0)
for _ in range(3000):
    y = total(x)
print(float(jax.block_until_ready(y)[0]))
"""


def _loop(give_up_s: int, **env) -> subprocess.CompletedProcess:
    """The loop in a fresh process on 8 CPU devices, XLA aborting a collective after ``give_up_s`` seconds."""
    environ = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
    environ.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                   f"--xla_cpu_collective_call_warn_stuck_timeout_seconds={give_up_s} "
                   f"--xla_cpu_collective_call_terminate_timeout_seconds={give_up_s}", **env)
    return subprocess.run([sys.executable, "-c", LOOP], env=environ, capture_output=True, text=True, timeout=300)


def test_a_dispatch_loop_over_eight_cpu_devices_deadlocks_with_the_default_pool_and_completes_with_ensure():
    stuck = _loop(2)
    assert stuck.returncode != 0 and "Termination timeout for `all reduce" in stuck.stderr, stuck.stderr[-2000:]
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = _loop(600, PJRT_NPROC=cpu_collectives.ensure(environ))
    assert done.returncode == 0 and done.stdout.strip() == "9.0", done.stderr[-2000:]


def test_the_pool_is_sized_only_for_several_cpu_devices_and_never_over_the_users_setting():
    assert cpu_collectives.host_device_count("--a=1 --xla_force_host_platform_device_count=4 "
                                             "--xla_force_host_platform_device_count=8") == 8
    assert cpu_collectives.host_device_count("") == 1
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert cpu_collectives.ensure(env) == env["PJRT_NPROC"] == str(max(os.cpu_count(), 64))
    for env in ({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}, {},
                {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PJRT_NPROC": "12"},
                {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "tpu"}):
        before = dict(env)
        assert cpu_collectives.ensure(env) is None and env == before


def test_the_command_line_and_the_tests_run_with_the_pool_sized():
    assert os.environ["PJRT_NPROC"] == str(max(os.cpu_count(), 64))  # tests/conftest.py, before JAX started
