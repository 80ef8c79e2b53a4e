"""A process that serves command-line runs one after another in itself, keeping the programs they compiled.

Most of a test's command-line run is JAX tracing, lowering and loading programs that the run before it built too
(a tiny GRPO run forked from the pre-imported interpreter of ``tests/cli_zygote.py``: ~5 s; the same run again in
a process that has run it: ~0.6 s, since ``rlhf_jax.runtime.programs`` keeps a process's programs by what they are
built from). This server runs each request as ``python -m module argv...`` would, but in its own interpreter:
``runpy`` runs the module as ``__main__`` in the request's working directory, environment, argv and output files,
and what a run changes of the interpreter's own state is put back before the next one (signal handlers, warnings
filters and their once-only registries, the root logger, JAX's settings, the standard streams); the non-daemon
threads a run started are joined, as the interpreter's exit would. The JAX backend is the first run's: a server
serves only runs with the ``XLA_FLAGS`` it started with.

What a fresh process gives and this server cannot: a run that restarts its own process (``trainer.env_vars``;
huge pages) raises here instead of calling ``os.execve``, and the client runs it again the other way; a run that
ends the process (``os._exit``) ends the server, whose exit status is then the run's. Tests of what a process
prints as it starts or ends, or of signals, use ``fresh=True`` or a ``Popen``. ``RLHF_JAX_TEST_FRESH_PROCESSES=1``
turns every run back into a fresh process.

Protocol (one JSON object per line): a request on stdin ``{"module", "argv", "env", "cwd", "stdout", "stderr"}``;
the reply on stdout ``{"returncode": R, "restart": bool, "retire": bool}``. The server ends when its stdin closes, or
after a reply with ``retire`` set: once its resident memory has grown past ``RETIRE_BYTES``, or after a run that
joined a multi-process group (``jax.distributed`` starts once per process).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading

# A server grows with the programs it keeps; past this it ends after its reply and the next run starts another.
RETIRE_BYTES = 2_500 * 2**20
# Servers kept per test process (one per XLA_FLAGS value: the tests' eight devices, one device, ...).
KEPT = 2


class _Restart(BaseException):
    """A run asked to replace its process (``os.execve``): it must run in a process of its own."""


def _refuse_exec(*args, **kwargs):
    raise _Restart()


def _spent() -> bool:
    """Whether this process can serve no further run: it holds too much memory, or a run made it one process of
    a group."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    distributed = sys.modules.get("jax._src.distributed")
    return rss > RETIRE_BYTES or getattr(getattr(distributed, "global_state", None), "client", None) is not None


class _Interpreter:
    """The interpreter-wide state a run may change, as it was before the first run."""

    def __init__(self):
        import logging
        import warnings

        self.streams = (sys.stdout, sys.stderr)
        self.filters = list(warnings.filters)
        self.root_handlers = list(logging.root.handlers)
        self.root_level = logging.root.level
        self.handlers = {s: signal.getsignal(s) for s in signal.valid_signals()
                         if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) is not None}

    def reset(self) -> None:
        """Back to the state a fresh interpreter starts every run in."""
        import logging
        import warnings

        sys.stdout, sys.stderr = self.streams
        warnings.filters[:] = self.filters
        for module in list(sys.modules.values()):  # the "shown once" memory of each warning's location
            registry = getattr(module, "__warningregistry__", None)
            if isinstance(registry, dict):
                registry.clear()
        warnings._filters_mutated()
        logging.root.handlers[:] = self.root_handlers
        logging.root.setLevel(self.root_level)
        for s, handler in self.handlers.items():
            if signal.getsignal(s) is not handler:
                signal.signal(s, handler)


def _jax_settings() -> dict:
    jax = sys.modules.get("jax")
    holders = getattr(getattr(jax, "config", None), "_value_holders", {}) if jax else {}
    return {name: holder.value for name, holder in holders.items()}


def _run(request: dict, preface: bytes, interpreter: _Interpreter) -> tuple[int, bool]:
    """(exit status, whether the run must restart in a process of its own) of one request."""
    import runpy
    import traceback

    enter_run(request, preface)
    interpreter.reset()
    threads, settings = set(threading.enumerate()), _jax_settings()
    code, restart = 1, False
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except _Restart:
        restart = True
    except BaseException:  # what the interpreter prints for an uncaught exception, and its status
        traceback.print_exc()
    for thread in threading.enumerate():  # the interpreter's exit waits for the run's non-daemon threads
        if thread not in threads and not thread.daemon and thread is not threading.current_thread():
            thread.join()
    changed = {name: value for name, value in _jax_settings().items() if settings.get(name, value) != value}
    for name in changed:
        sys.modules["jax"].config.update(name, settings[name])
    for stream in (sys.stdout, sys.stderr, *interpreter.streams):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    os.close(null)
    return code, restart


def serve() -> None:
    preface = preload()
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)
    os.execve = os.execv = _refuse_exec  # a run's restart of its process (see _Restart)
    interpreter = _Interpreter()
    for line in requests:
        code, restart = _run(json.loads(line), preface, interpreter)
        retire = _spent()
        replies.write(json.dumps({"returncode": code, "restart": restart, "retire": retire}) + "\n")
        replies.flush()
        if retire:
            return


class Server:
    """The client's side of one server."""

    def __init__(self, env: dict, cwd: str):
        self.env, self.cwd = env, cwd
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=cwd)
        self.pending = b""
        self.retired = False

    def alive(self) -> bool:
        return not self.retired and self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            self.proc.wait()

    def run(self, request: dict, timeout: float | None) -> tuple[int | None, bool]:
        """(exit status, timed out) of one run; status None: the run must run in a process of its own."""
        import time

        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:  # the server is gone (killed between runs): the run goes to a process of its own
            self.retired = True
            return None, False
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                self.proc.kill()
                self.proc.wait()
                return -signal.SIGKILL, True
            chunk = os.read(fd, 4096)
            if not chunk:  # the run ended the process (os._exit, a crash): its status is the run's
                return self.proc.wait(), False
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        reply = json.loads(line)
        if reply["retire"]:
            self.retired = True
            self.proc.stdin.close()
            self.proc.wait()
        return (None if reply["restart"] else reply["returncode"]), False


_servers: dict[tuple, Server] = {}


def server_for(env: dict, cwd: str) -> Server:
    """The server for runs with ``env`` in ``cwd``: chosen by its ``XLA_FLAGS`` and by ``RLHF_JAX_CACHE`` (read
    when a module of ours is imported); the least recently used one is closed when more than KEPT would be alive."""
    key = (env.get("XLA_FLAGS", ""), env.get("RLHF_JAX_CACHE"), cwd)
    server = _servers.pop(key, None)
    if server is None or not server.alive():
        server = Server(env, cwd)
    _servers[key] = server
    while len(_servers) > KEPT:
        _servers.pop(next(iter(_servers))).close()
    return server


if __name__ == "__main__":  # run as a script, beside cli_zygote.py (sys.path[0] is this folder until a run)
    from cli_zygote import _exit_code, enter_run, preload

    serve()
