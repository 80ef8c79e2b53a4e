"""Run untrusted Python (a model's answer) in a child process with limits, and say how it ended.

The child is ``python -I`` in a fresh temporary directory (its cwd and HOME), with a minimal environment and:

- CPU seconds (RLIMIT_CPU) and a wall-clock limit: past either the whole process group is killed;
- address space (RLIMIT_AS), so a huge allocation fails with MemoryError; file size (RLIMIT_FSIZE); no core files;
- an audit hook installed before the code runs (it cannot be removed): no new processes (fork, exec, spawn,
  subprocess, os.system), no sockets, no ctypes, and no file opened for writing outside the directory;
- where the kernel lets this process do it (root or user namespaces), a network namespace of its own, so even
  code that escaped the hook has no network.

The guard is for model answers on a training machine, not for adversaries with kernel exploits: run the
trainer in a container or VM for that.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# Installed in the child before the answer runs; GUARD_DIR is the sandbox directory.
_GUARD = r'''
import os, resource, sys
_ROOT = os.path.realpath(os.environ.pop("GUARD_DIR"))
for _name, _value in (("RLIMIT_CPU", os.environ.pop("GUARD_CPU")), ("RLIMIT_AS", os.environ.pop("GUARD_AS")),
                      ("RLIMIT_FSIZE", os.environ.pop("GUARD_FSIZE")), ("RLIMIT_CORE", "0")):
    resource.setrlimit(getattr(resource, _name), (int(_value), int(_value) + (_name == "RLIMIT_CPU")))
try:  # an empty network namespace where the kernel allows it (root or user namespaces); else the hook alone
    import ctypes
    ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET
    del ctypes
except Exception:
    pass
for _m in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
    del sys.modules[_m]
_BLOCKED_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "os.startfile",
                   "subprocess.Popen", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind",
                   "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
                   "os.kill", "os.killpg", "signal.pthread_kill"}
_BLOCKED_MODULES = {"ctypes", "_ctypes", "cffi"}

def _hook(event, args):
    if event in _BLOCKED_EVENTS:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0].split(".")[0] in _BLOCKED_MODULES:
        raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
        if writing and not isinstance(path, int):
            full = os.path.realpath(os.fsdecode(path))
            if full != _ROOT and not full.startswith(_ROOT + os.sep) and full != "/dev/null":
                raise PermissionError(f"sandbox: writing {full} is not allowed")
    if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
                 "os.truncate", "shutil.rmtree"):
        for path in args:
            if isinstance(path, (str, bytes, os.PathLike)):
                full = os.path.realpath(os.fsdecode(path))
                if full != _ROOT and not full.startswith(_ROOT + os.sep):
                    raise PermissionError(f"sandbox: {event} on {full} is not allowed")

sys.addaudithook(_hook)
import runpy
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
'''

@dataclasses.dataclass(frozen=True)
class Limits:
    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 1024
    file_mb: int = 16
    output_bytes: int = 1 << 20  # of stdout and of stderr kept


@dataclasses.dataclass(frozen=True)
class RunResult:
    status: str  # ok | error (non-zero exit or exception) | timeout (CPU or wall) | killed (by a signal)
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
    """Run ``code`` as a script with ``stdin``; never raises for anything the code does."""
    root = tempfile.mkdtemp(prefix="rlhf_jax_sandbox_")
    try:
        with open(os.path.join(root, "main.py"), "w") as f:
            f.write(code)
        with open(os.path.join(root, "guard.py"), "w") as f:
            f.write(_GUARD)
        # The limits are set by the guard itself (no preexec_fn: the trainer process has threads).
        env = {"PATH": "/usr/bin:/bin", "HOME": root, "GUARD_DIR": root, "PYTHONIOENCODING": "utf-8",
               "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8", "GUARD_CPU": str(max(1, int(limits.cpu_s + 0.999))),
               "GUARD_AS": str(limits.memory_mb << 20), "GUARD_FSIZE": str(limits.file_mb << 20)}
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-I", "guard.py"], cwd=root, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(stdin.encode(), timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
        seconds = time.monotonic() - start
        code_ = proc.returncode
        if timed_out or code_ in (-signal.SIGXCPU, -signal.SIGKILL) and seconds >= min(limits.cpu_s, limits.wall_s):
            status = "timeout"
        elif code_ < 0:
            status = "killed"
        elif code_ != 0:
            status = "error"
        else:
            status = "ok"
        keep = limits.output_bytes
        return RunResult(status, code_, out[:keep].decode("utf-8", "replace"), err[:keep].decode("utf-8", "replace"),
                         seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
