"""Huge-page malloc for XLA:CPU buffers: when the command restarts, and that the restart removes the page faults."""

import json
import subprocess
import sys

from rlhf_jax import hostmem

# A child that restarts itself as rlhf_jax.main does, then runs a jitted program with a 256 MiB
# temporary twice and reports the minor page faults of the second run.
CHILD = r"""
import json, os, resource
from rlhf_jax.hostmem import reexec_with_hugepages
reexec_with_hugepages()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jnp.sin(x)[::-1] * jnp.cos(x)))  # a full-size temporary between the two ops
x = jnp.arange(64 * 1024 * 1024, dtype=jnp.float32)
f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
f(x).block_until_ready()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES", ""), "faults": faults}))
"""


def run_child(**env):
    import os

    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", **env))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_restart_only_when_the_kernel_gives_huge_pages_on_request():
    assert hostmem.wanted({}, mode="madvise") == sys.platform.startswith("linux")
    assert not hostmem.wanted({}, mode="never") and not hostmem.wanted({}, mode="always")
    assert not hostmem.wanted({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, mode="madvise")  # the user's choice
    assert not hostmem.wanted({"RLHF_JAX_HUGEPAGES": "0"}, mode="madvise")
    assert hostmem.tunables_with_hugepages("") == "glibc.malloc.hugetlb=1"
    assert hostmem.tunables_with_hugepages("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_restarted_process_faults_in_far_fewer_pages():
    pages = 256 * 1024 * 1024 // 4096
    plain = run_child(RLHF_JAX_HUGEPAGES="0")
    assert "hugetlb" not in plain["tunables"]
    restarted = run_child()
    if hostmem.thp_mode() == "madvise":
        assert "glibc.malloc.hugetlb=1" in restarted["tunables"]
        # 4 KiB pages: every page of the temporary faults again on every run; huge pages: a few hundred.
        assert plain["faults"] > pages // 2, plain
        assert restarted["faults"] < plain["faults"] // 10, (plain, restarted)
    else:  # no huge pages on request from this kernel: nothing to gain, no restart
        assert "hugetlb" not in restarted["tunables"]
