"""A Python process with the heavy libraries already imported, which forks one child per command-line run.

The tests start ~150 runs of ``python -m rlhf_jax.<module> ...``; each fresh interpreter spends ~5 s importing
jax, flax, optax, orbax, transformers and torch before doing anything of ours. This server imports those
third-party libraries once (nothing of rlhf_jax's, and no JAX backend: XLA reads its flags and creates its
devices in each child, as in a fresh process) and then, per request, forks a child that becomes exactly such a
run: its own working directory, environment, argv, stdin from /dev/null, stdout and stderr into the requester's
files, ``runpy`` running the module as ``__main__`` and the interpreter's exit up to its finalization (threads
joined, atexit handlers run, streams flushed; module finalization is skipped, see ``_exit_without_finalizing``: a
test of what a run prints while the interpreter finalizes needs a fresh process, which ``popen`` arguments give).
Whatever the imports printed on stderr is written first into every child's stderr, so a test that reads a
run's whole stderr sees at least what a fresh process would print.

:func:`run_module` is the tests' side: ``subprocess.run`` semantics (see its docstring for who serves a run).

Protocol (one JSON object per line): a request on stdin ``{"module", "argv", "env", "cwd", "stdout",
"stderr"}``; the replies on stdout ``{"pid": N}`` once the child exists, then ``{"returncode": R}`` (negative:
killed by that signal, as ``subprocess`` reports it). The server ends when its stdin closes.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

# Third-party only: a module of ours imported here, but not by a real run, could hide a missing import.
PRELOAD = ("numpy", "jax", "jax.numpy", "flax", "flax.nnx", "optax", "orbax.checkpoint", "tensorstore",
           "ml_collections", "transformers", "tokenizers", "torch", "safetensors", "yaml",
           # what transformers imports when a model family's configuration is first read (torch.distributed's)
           "transformers.activations", "transformers.core_model_loading",
           # what a run imports on first use: the data loader, the Pallas kernels (TPU kernels run interpreted on CPU)
           "grain", "jax.experimental.pallas", "jax.experimental.pallas.tpu", "jax.experimental.pallas.triton")
# Names transformers resolves lazily on first use (AutoTokenizer imports torch through its configuration code).
PRELOAD_ATTRS = (("transformers", "AutoTokenizer"), ("transformers", "AutoConfig"),
                 ("transformers", "PreTrainedTokenizerFast"))


def preload() -> bytes:
    """Import PRELOAD with fd 2 captured; returns what the imports wrote there."""
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        sys.stderr.flush()
        os.dup2(captured.fileno(), 2)
        try:
            for name in PRELOAD:
                importlib.import_module(name)
            for module, attr in PRELOAD_ATTRS:
                getattr(sys.modules[module], attr)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return captured.read()


def enter_run(request: dict, preface: bytes) -> None:
    """Give this process the run's working directory, environment, standard streams (stdin from /dev/null, the
    output files, ``preface`` first on stderr) and the ``sys.path[0]`` and argv ``python -m module`` gives."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    os.write(2, preface)
    sys.path[0] = request["cwd"]  # what ``python -m`` puts first
    sys.argv = [request["module"], *request["argv"]]


def become_run(request: dict, preface: bytes, requests) -> None:
    """In the forked child: turn this process into ``python -m module argv...`` (does not return normally)."""
    import runpy

    requests.close()
    enter_run(request, preface)
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    _exit_without_finalizing(code)


def _exit_code(code) -> int:
    """The status the interpreter gives ``sys.exit(code)`` (printing a non-integer code, as it does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _exit_without_finalizing(code: int) -> None:
    """End the child as the interpreter's exit does up to its finalization, then leave at once.

    The interpreter's exit waits for non-daemon threads, runs the atexit handlers and flushes the standard
    streams; then it finalizes every module, which in a child forked from a process holding jax, torch and
    transformers frees (and so first copies, page by page) the parent's whole heap: ~1.4 s a run here, for
    nothing a run would observe. An exception other than SystemExit is not caught on the way here: it ends
    the child through the interpreter's own path, traceback and all.
    """
    import atexit
    import threading

    threading._shutdown()  # what the interpreter's exit does first: join the non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def serve() -> None:
    preface = preload()
    from jax._src import xla_bridge

    assert not xla_bridge._backends, "a preloaded library created a JAX backend; children could not set XLA_FLAGS"
    requests = os.fdopen(os.dup(0), "r")
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 again, so that a child's stdin never reads the requests
    replies = sys.stdout
    for line in requests:
        request = json.loads(line)
        replies.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            become_run(request, preface, requests)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


def serve_detached() -> None:
    """Like ``serve``, but each child runs beside the others: the server replies ``{"pid": N}`` as it forks and
    ``{"exit": N, "returncode": R}`` whenever a child ends (the several processes of one multi-process run)."""
    preface = preload()
    requests = open(os.dup(0), "rb", buffering=0)
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)
    replies, pending, children, reading = sys.stdout, b"", set(), True

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    while reading or children:
        if select.select([requests] if reading else [], [], [], 0.05)[0]:
            chunk = requests.read(65536)
            reading, pending = bool(chunk), pending + chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                replies.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    become_run(json.loads(line), preface, requests)
                children.add(pid)
                reply({"pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                reply({"exit": pid, "returncode": os.waitstatus_to_exitcode(status)})


# Variables read only after start-up (XLA's flags when the backend is created, wandb's mode when a run is
# opened, and rlhf_jax's own, which the server never imports): a child may differ from the server in these; any
# other difference needs a fresh interpreter.
READ_AFTER_START = frozenset({"XLA_FLAGS", "WANDB_MODE"})
OURS = "RLHF_JAX_"
FRESH = "RLHF_JAX_TEST_FRESH_PROCESSES"


class _Server:
    def __init__(self, env: dict, cwd: str):
        self.cwd = cwd
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=cwd)
        self.pending = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def reply(self, deadline: float | None) -> dict | None:
        """The next reply line, or None when ``deadline`` (time.monotonic) passes first."""
        import time

        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError("the test runs' fork server ended unexpectedly")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, request: dict, timeout: float | None) -> tuple[int, bool]:
        """(returncode, timed out) of one forked run."""
        import time

        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        pid = self.reply(None)["pid"]
        done = self.reply(None if timeout is None else time.monotonic() + timeout)
        if done is not None:
            return done["returncode"], False
        os.kill(pid, signal.SIGKILL)
        return self.reply(None)["returncode"], True


_server: _Server | None = None
_lock = threading.Lock()


def _hugepage_env(env: dict) -> dict:
    """``env`` as the command's own restart with huge-page malloc would have it (rlhf_jax/hostmem.py)."""
    from rlhf_jax import hostmem

    if not hostmem.wanted(env):
        return env
    return dict(env, GLIBC_TUNABLES=hostmem.tunables_with_hugepages(env.get("GLIBC_TUNABLES", "")))


def _start_up_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in READ_AFTER_START and not k.startswith(OURS)}


def _server_for(env: dict, cwd: str) -> _Server | None:
    """The server (started on first use, with the tests' own environment on CPU), or None when ``env`` differs
    from it in a variable read at start-up."""
    global _server
    standard = _start_up_env(dict(os.environ, JAX_PLATFORMS="cpu"))
    if _start_up_env(env) != standard:
        return None
    if _server is None or not _server.alive() or _server.cwd != cwd:
        _server = _Server(_hugepage_env(standard), cwd)
    return _server


def run_module(module: str, args: list[str], *, env: dict, cwd: str, timeout: float | None = None
               ) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", module, *args], env=env, cwd=cwd, capture_output=True, text=True,
    stdin=DEVNULL, timeout=timeout)``, run where the environment allows (it is ``env`` but for
    :data:`READ_AFTER_START`) by the server of tests/cli_warm.py (a process that ran runs before and kept their
    programs), or by a forked child of this module's server when the run restarts its process; by a fresh process
    when another run holds the servers, the environment differs, or ``RLHF_JAX_TEST_FRESH_PROCESSES`` is set."""
    command = [sys.executable, "-m", module, *args]
    standard = _start_up_env(dict(os.environ, JAX_PLATFORMS="cpu"))
    if os.environ.get(FRESH) == "1" or _start_up_env(env) != standard or not _lock.acquire(blocking=False):
        return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    try:
        with tempfile.TemporaryDirectory(prefix="rlhf_jax-test-run-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            for path in (out, err):
                open(path, "w").close()
            request = dict(module=module, argv=list(args), env=_hugepage_env(dict(env)), cwd=cwd, stdout=out,
                           stderr=err)
            from tests import cli_warm

            returncode, timed_out = cli_warm.server_for(request["env"], cwd).run(request, timeout)
            if returncode is None:  # the run restarts its own process: a forked child
                returncode, timed_out = _server_for(env, cwd).run(request, timeout)
            with open(out) as f_out, open(err) as f_err:
                stdout, stderr = f_out.read(), f_err.read()
    finally:
        _lock.release()
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)


class Forked:
    """A run forked by the detached server, with what the tests use of ``subprocess.Popen``: its stdout and
    stderr go to files, which ``communicate`` reads once it has ended."""

    def __init__(self, server: "_Detached", pid: int, args: list[str], stdout: str, stderr: str):
        self.server, self.pid, self.args, self.paths = server, pid, args, (stdout, stderr)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        with self.server.ended:
            self.returncode = self.server.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.ended:
            if not self.server.ended.wait_for(lambda: self.pid in self.server.exits, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended, and the server reaped it, before the server's report arrived
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return _read_outputs(self.paths)


def _read_outputs(paths: tuple[str, str]) -> tuple[str, str]:
    return tuple(open(path).read() if path != os.devnull else "" for path in paths)


class _Fresh(subprocess.Popen):
    """A fresh process whose stdout and stderr go to files, which ``communicate`` reads as ``Forked``'s does."""

    def __init__(self, command: list[str], paths: tuple[str, str], **kwargs):
        self.paths = paths
        super().__init__(command, stdin=subprocess.DEVNULL, stdout=open(paths[0], "w"), stderr=open(paths[1], "w"),
                         **kwargs)

    def communicate(self, input=None, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return _read_outputs(self.paths)


class _Detached:
    """The detached server (``serve_detached``) and a thread that reads its replies."""

    def __init__(self, env: dict, cwd: str):
        import queue

        self.cwd, self.exits, self.pids = cwd, {}, queue.Queue()
        self.ended, self.writing = threading.Condition(), threading.Lock()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--detached"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=cwd)
        threading.Thread(target=self._read, daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            if "exit" in message:
                with self.ended:
                    self.exits[message["exit"]] = message["returncode"]
                    self.ended.notify_all()
            else:
                self.pids.put(message["pid"])

    def fork(self, request: dict) -> int:
        with self.writing:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            return self.pids.get(timeout=120)


_detached: _Detached | None = None
_detached_lock = threading.Lock()


def popen_module(module: str, args: list[str], *, env: dict, cwd: str, stdout: str = os.devnull,
                 stderr: str = os.devnull):
    """``subprocess.Popen([python, "-m", module, *args], env=env, cwd=cwd, stdin=DEVNULL)`` with its output in the
    files ``stdout`` and ``stderr``: a child forked by the detached server when ``env`` allows, else a fresh one."""
    global _detached
    command = [sys.executable, "-m", module, *args]
    standard = _start_up_env(dict(os.environ, JAX_PLATFORMS="cpu"))
    if os.environ.get(FRESH) == "1" or _start_up_env(env) != standard:
        return _Fresh(command, (stdout, stderr), env=env, cwd=cwd)
    with _detached_lock:
        if _detached is None or not _detached.alive() or _detached.cwd != cwd:
            _detached = _Detached(_hugepage_env(standard), cwd)
        server = _detached
    for path in (stdout, stderr):
        if path != os.devnull:
            open(path, "w").close()
    request = dict(module=module, argv=list(args), env=_hugepage_env(dict(env)), cwd=cwd, stdout=stdout, stderr=stderr)
    return Forked(server, server.fork(request), command, stdout, stderr)


if __name__ == "__main__":
    serve_detached() if sys.argv[1:] == ["--detached"] else serve()
