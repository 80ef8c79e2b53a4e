"""Huge pages for XLA:CPU's per-execution buffers: re-exec once with glibc's ``malloc.hugetlb`` tunable.

XLA:CPU allocates each execution's temporary buffer afresh (``posix_memalign`` from an executor
thread's arena, so glibc serves anything above a few MiB with ``mmap`` and returns it with
``munmap``). For a SmolLM2 training micro-batch that buffer is 1.5 GB: every execution faults in
~360,000 fresh 4 KiB pages, about a second of kernel time over the two cores, 15-20 % of the
micro-batch's wall time. With ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc >= 2.35) malloc
asks for transparent huge pages on the memory it maps, and the same buffer takes ~700 faults.

glibc reads its tunables only when a process starts, so :func:`reexec_with_hugepages` restarts
the current command once, with the tunable added, before anything heavy is imported. It does
nothing when the kernel gives no transparent huge pages on request (``never``, or ``always``
where every large mapping gets them already), off Linux, when the tunable is already set, or
when ``RLHF_JAX_HUGEPAGES=0``.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
OPT_OUT = "RLHF_JAX_HUGEPAGES"


def thp_mode(path: str = THP_MODE_FILE) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``), None when unknown."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def wanted(environ=os.environ, mode: str | None = None) -> bool:
    """Whether restarting with the tunable would change how this process gets memory."""
    if not sys.platform.startswith("linux") or environ.get(OPT_OUT, "1") == "0":
        return False
    if "glibc.malloc.hugetlb" in environ.get("GLIBC_TUNABLES", ""):
        return False  # already set (by us before the restart, or by the user)
    return (thp_mode() if mode is None else mode) == "madvise"


def tunables_with_hugepages(current: str) -> str:
    return f"{current}:{TUNABLE}" if current else TUNABLE


def reexec_with_hugepages(argv: list[str] | None = None) -> None:
    """Restart this Python command with huge-page malloc (never returns) when :func:`wanted`; else return."""
    if not wanted():
        return
    env = dict(os.environ, GLIBC_TUNABLES=tunables_with_hugepages(os.environ.get("GLIBC_TUNABLES", "")))
    args = list(sys.orig_argv) if argv is None else argv
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, args, env)
    except OSError:
        return  # cannot restart (unusual sandbox): run on as is
