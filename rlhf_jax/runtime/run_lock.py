"""One run per output directory: a second run started on the same ``trainer.default_local_dir`` refuses.

Process 0 holds an exclusive ``flock`` on ``<dir>/.run.lock`` (which also records its pid and host) for
as long as the run lives; the kernel drops it when the process ends, however it ends, so a crashed run
leaves no stale lock. The outcome is shared with every process, so all of them stop together.
"""

from __future__ import annotations

import fcntl
import os
import socket

import numpy as np

from rlhf_jax.parallel import groups
from rlhf_jax.parallel.hosts import sum_over_processes

LOCK_NAME = ".run.lock"
_held: dict[str, tuple[int, int]] = {}  # directory -> (file descriptor, holders in this process)


class DirectoryInUse(ValueError):
    """Another live run writes to the same directory."""


def acquire(directory: str) -> None:
    """Take the directory's lock (re-entrant within a process); raise DirectoryInUse if another run holds it."""
    directory = os.path.abspath(os.path.expanduser(directory))
    if directory in _held:
        fd, count = _held[directory]
        _held[directory] = (fd, count + 1)
        return
    fd, holder = None, ""
    if groups.current().is_first:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            fd = None
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    refused = sum_over_processes(np.asarray([groups.current().is_first and fd is None], np.int64))[0]
    if refused:
        raise DirectoryInUse(f"trainer.default_local_dir {directory} is in use by another run "
                             f"({holder or 'see process 0'}); wait for it to end or choose another directory")
    _held[directory] = (fd if fd is not None else -1, 1)


def release(directory: str) -> None:
    directory = os.path.abspath(os.path.expanduser(directory))
    if directory not in _held:
        return
    fd, count = _held.pop(directory)
    if count > 1:
        _held[directory] = (fd, count - 1)
    elif fd >= 0:
        os.close(fd)  # closing the descriptor drops the flock
