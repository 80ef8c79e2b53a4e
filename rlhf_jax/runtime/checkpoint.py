"""Orbax checkpoints that survive preemption: atomic, asynchronous, restorable onto any mesh.

Each step's checkpoint holds separate items so a reader can take only what it
needs (the export tool restores only ``actor_params``):

- ``actor_params``, ``actor_opt``, ``critic_params``, ``critic_opt``: array trees,
  stored as flat ``{path: array}`` dicts so that any pytree (NNX state, optax
  states) round-trips;
- ``extra`` (JSON): step, epoch, RNG, KL-controller value, the data iterator's
  state, and the model/tokenizer description the export tool rebuilds from.

Orbax writes each step under a temporary name and renames it once complete, and
deletes old steps (``max_to_keep``) only after a new one is final, so a process
killed at any moment leaves the last complete checkpoint intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
from typing import Any

import jax
import numpy as np
from rlhf_jax.parallel import groups
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

ARRAY_ITEMS = ("actor_params", "actor_opt", "critic_params", "critic_opt")


class CheckpointError(ValueError):
    """A checkpoint cannot be read or written; the message names the directory."""


class CheckpointWriteError(CheckpointError):
    """Saving a checkpoint failed (a full disk, a quota, a lost mount). The checkpoints completed before it are
    intact; the storage library's writer threads may still hold the failed write, so the process should end
    without waiting for them."""


class CheckpointReadError(CheckpointError):
    """A file of a checkpoint cannot be read: ``path`` is the file (or the item directory) that failed, ``reason``
    the operating system's or the storage library's short words for it."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


# A TensorStore error names the file it failed on (`... at local file "<path>": <reason>`); its spec dumps follow.
_STORE_FILE = re.compile(r'(?:\s(?:at|of))?\slocal file "([^"]+)"')
_STORE_CODE = re.compile(r"^([A-Z][A-Z_]+): ")


def _read_failure(error: BaseException, fallback: str) -> tuple[str, str]:
    """(file, short reason) of a failed read. The innermost error that names a file or has the OS's words wins:
    Orbax wraps TensorStore's errors in messages that embed the store's repr, which say nothing more."""
    chain = [error]
    while len(chain) < 16 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    for e in reversed(chain):
        if isinstance(e, OSError) and e.strerror:
            return e.filename or fallback, e.strerror
        text = (str(e).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0]
        found, code = list(_STORE_FILE.finditer(text)), _STORE_CODE.match(text)
        if found and code:
            last = found[-1]
            rest = text[last.end():]
            # After the file: ": <reason>"; or the file sits inside its clause ("Metadata at ... does not exist").
            clause = text[text.rfind(": ", 0, last.start()) + 2:last.start()]
            reason = rest[2:] if rest.startswith(": ") else clause + rest
            reason = re.sub(r"; at (?:uncompressed )?byte \d+", "", reason).strip()
            return last.group(1).rstrip("/"), f"{code.group(1)}: {reason}"
    inner = chain[-1]
    first = (str(inner).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
    return fallback, f"{type(inner).__name__}: {first}"[:300]


def _os_error(error: BaseException) -> str:
    """The operating system's words from a storage error (e.g. 'No space left on device'), else its first line."""
    text = str(error)
    found = re.findall(r"([^:\[\]]+?) \[os_error_code='?\d+'?\]", text)
    if found:
        return found[-1].strip()
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    # the words may stand apart from their code (seen: a zarr metadata write, first line ending 'Failed writing: "')
    for code in _STORAGE_ERRNOS:
        if os.strerror(code) in text:
            return os.strerror(code)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]


_STORAGE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO)


def _key_name(path) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", ".", jax.tree_util.keystr(path)).strip(".") or "root"


def to_flat_dict(tree: Any) -> dict[str, jax.Array]:
    """``{readable.path: leaf}`` for every array leaf of ``tree``."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = _key_name(path)
        if name in flat:
            raise ValueError(f"two leaves share the checkpoint name {name}")
        flat[name] = leaf
    return flat


def from_flat_dict(template: Any, flat: dict[str, Any]) -> Any:
    """Rebuild a tree shaped like ``template`` from ``to_flat_dict`` output."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    missing = [_key_name(p) for p, _ in paths if _key_name(p) not in flat]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} arrays, e.g. {missing[:3]}")
    return jax.tree_util.tree_unflatten(treedef, [flat[_key_name(p)] for p, _ in paths])


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a tree of arrays: the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _write_shards_whole_on_cpu() -> None:
    """Orbax splits each replicated shard among its replicas by default ("replica-parallel" writes), slicing it on
    its device first: across TPU hosts that shares the writing out. CPU devices all live in this host's memory, so
    there each slice is one more copy and one more small program (a tiny run's save sliced 480 times, 0.7 s): on
    CPU every shard is written whole by its first replica, as Orbax does on GPUs. The files are the same."""
    global _SHARDS_WHOLE
    if not _SHARDS_WHOLE and jax.devices()[0].platform == "cpu":
        with _quiet_absl(True):  # Orbax warns of the handler it replaces
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
        _SHARDS_WHOLE = True


_SHARDS_WHOLE = False


class Checkpointer:
    """Saves and restores training state under ``directory`` with an Orbax CheckpointManager."""

    def __init__(self, directory: str, *, max_to_keep: int | None = None, async_save: bool = True,
                 read_only: bool = False):
        """``read_only``: a reader (resume lookup, export) that creates and deletes nothing. Only the run's writer
        deletes the unfinished steps a killed run left: two managers deleting them at once race, and the loser's
        'No such file or directory' surfaces at its first save."""
        self.directory = os.path.abspath(os.path.expanduser(directory))
        _write_shards_whole_on_cpu()
        group = groups.current()
        # A group of one process in a run of several (a split run's only training process) holds every array whole,
        # which Orbax refuses to write in a multi-process run (it takes it for a per-host value): it saves host
        # copies, which read back into the same layouts.
        self._host_copies = group.count == 1 and not group.spans_the_run()
        processes = {} if group.spans_the_run() else {"multiprocessing_options": ocp.options.MultiprocessingOptions(
            primary_host=group.processes[0], active_processes=set(group.processes))}  # this group's alone
        if processes and not read_only:  # Orbax creates the directory only for a manager of every process
            os.makedirs(self.directory, exist_ok=True)
        with _quiet_absl(read_only):  # Orbax warns of each option a reader turns off, and of the reading itself
            self._options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=not processes and not read_only,
                enable_async_checkpointing=async_save, cleanup_tmp_directories=not read_only, read_only=read_only,
                **processes)
            self.manager = ocp.CheckpointManager(self.directory, options=self._options)
        self._writing: int | None = None  # the step whose (asynchronous) save may still be in flight
        self.failed: CheckpointWriteError | None = None

    @contextlib.contextmanager
    def _writes(self, step: int):
        """Turn a failed save (of ``step`` or of the one still in flight) into one CheckpointWriteError."""
        if self.failed is not None:
            raise self.failed
        try:
            yield
        except Exception as e:  # noqa: BLE001 - whatever the storage layer raises, the message says what failed
            failed = self._writing if self._writing is not None else step
            kept = self.complete_steps()
            kept = [s for s in kept if s != failed]
            self.failed = CheckpointWriteError(
                f"cannot write the checkpoint of step {failed} in {self.directory}: {_os_error(e)}; "
                + (f"the checkpoint of step {kept[-1]} is intact" if kept else "no earlier checkpoint exists")
                + " (free space and run the same command to resume)")
            raise self.failed from None

    def complete_steps(self) -> list[int]:
        """Steps whose checkpoint was completed (listed from the directory, as a new run would see them)."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())

    def set_aside(self, step: int) -> str:
        """Rename an unreadable step to ``<step>.unreadable[.N]`` (kept for inspection, no longer a step)."""
        from rlhf_jax.parallel.hosts import sum_over_processes

        src = os.path.join(self.directory, str(step))
        dst, n = src + ".unreadable", 1
        while os.path.exists(dst):
            dst, n = f"{src}.unreadable.{n}", n + 1
        if groups.current().is_first:
            os.rename(src, dst)
        sum_over_processes(np.zeros(1))  # every process waits for the rename before listing steps again
        self.manager.close()
        # the first manager's clean-up of unfinished steps may still run: a second one would race it
        self._options = dataclasses.replace(self._options, cleanup_tmp_directories=False)
        self.manager = ocp.CheckpointManager(self.directory, options=self._options)
        return dst

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, arrays: dict[str, Any], extra: dict) -> None:
        """Start saving ``arrays`` (item name -> tree) and ``extra`` for ``step``; returns before the write ends."""
        if self._host_copies:
            arrays = {name: None if tree is None else jax.device_get(tree) for name, tree in arrays.items()}
        items = {name: ocp.args.StandardSave(to_flat_dict(tree)) for name, tree in arrays.items() if tree is not None}
        items["extra"] = ocp.args.JsonSave(extra)
        self.check()  # a failure of the previous save is its own, not this one's
        with self._writes(step):  # also reports a failure of the previous save, which this one waits for
            self.manager.save(step, args=ocp.args.Composite(**items))
            self._writing = step
            self.manager.check_for_errors()

    def check(self) -> None:
        """Raise CheckpointWriteError if the save in flight has failed so far (returns at once)."""
        if self._writing is None:
            return
        if not self.manager.is_saving_in_progress():
            # Over: Orbax's finalize thread has taken the writers' error, which only waiting for it reports.
            self.wait()
            return
        with self._writes(self._writing):
            self.manager.check_for_errors()

    def wait(self) -> None:
        with self._writes(self._writing or 0):
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        self._writing = None

    def _restore_item(self, step: int, name: str, args) -> Any:
        """One item of a step; a failure is a CheckpointReadError naming the file that failed and why."""
        item_dir = os.path.join(self.directory, str(step), name)
        if not os.path.isdir(item_dir):
            raise CheckpointReadError(item_dir, os.strerror(errno.ENOENT))
        try:
            return self.manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]
        except Exception as e:  # noqa: BLE001 - whatever layer of Orbax or TensorStore noticed the damage
            raise CheckpointReadError(*_read_failure(e, item_dir)) from e

    def restore_extra(self, step: int) -> dict:
        return self._restore_item(step, "extra", ocp.args.JsonRestore())

    def restore_arrays(self, step: int, templates: dict[str, Any]) -> dict[str, Any]:
        """Restore the named items into trees shaped (and sharded) like ``templates`` (trees of arrays or abstract)."""
        out = {}
        for name, t in templates.items():
            target = to_flat_dict(abstract_like(t) if _concrete(t) else t)
            flat = self._restore_item(step, name, ocp.args.StandardRestore(target))
            try:
                out[name] = from_flat_dict(t, flat)
            except ValueError as e:  # saved from another model
                raise CheckpointReadError(os.path.join(self.directory, str(step), name), str(e)) from None
        return out

    def close(self) -> None:
        """Wait for the save in flight and release the manager; after a failed save, release only."""
        try:
            if self.failed is None:
                self.wait()
        finally:
            if self.failed is None:
                self.manager.close()


@contextlib.contextmanager
def _quiet_absl(quiet: bool):
    logger = logging.getLogger("absl")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _concrete(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and isinstance(leaves[0], jax.Array)


def resolve_resume(root: str, mode: str, resume_from_path: str | None) -> tuple[str, int | None]:
    """(checkpoint directory, step to restore or None) for trainer.resume_mode.

    auto: the latest complete step under ``root`` if any; disable: none;
    resume_path: ``resume_from_path``, either a step directory (``.../checkpoints/<step>``)
    or a checkpoint root (its latest step).
    """
    if mode == "disable":
        return root, None
    if mode == "auto":
        ckpt = Checkpointer(root, async_save=False, read_only=True)
        step = ckpt.latest_step()
        ckpt.close()
        return root, step
    if mode != "resume_path":
        raise ValueError(f"trainer.resume_mode must be auto, disable or resume_path, got {mode!r}")
    if not resume_from_path:
        raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    path = os.path.abspath(os.path.expanduser(resume_from_path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"trainer.resume_from_path {path!r} does not exist")
    base = os.path.basename(path.rstrip("/"))
    if base.isdigit():
        return os.path.dirname(path), int(base)
    ckpt = Checkpointer(path, async_save=False, read_only=True)
    step = ckpt.latest_step()
    ckpt.close()
    if step is None:
        raise FileNotFoundError(f"trainer.resume_from_path {path!r} holds no complete checkpoint")
    return path, step
