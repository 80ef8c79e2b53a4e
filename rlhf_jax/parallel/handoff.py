"""Hand-offs between two groups of processes of one ``jax.distributed`` run, each wait bounded by a deadline.

A run that samples on some processes and trains on others moves two things between them: weights (training ->
sampling, after updates) and trajectories (sampling -> training). Both are pytrees of arrays sharded over one
group's devices that the other group wants sharded over its own. :class:`Channel` moves them device to device with
``jax.experimental.transfer`` (each process runs a transfer server; its address is published in the distributed
runtime's key-value store):

- the plan of a transfer is a pure function of the two layouts (:func:`transfer_plan`): for every destination
  device, the blocks of the source shards that overlap the block it holds. Both sides compute it, so no request
  travels; a digest the sender publishes with its "ready" mark catches two sides that disagree;
- the sender offers, per destination device, one bundle of its overlapping blocks (an offer can be pulled once);
  the receiver pulls each bundle onto the device that needs it and stitches the blocks there;
- every wait has a deadline: the "ready" mark (``blocking_key_value_get``) and the pulls themselves (in a worker
  thread: a pull from a dead peer never returns). A missed deadline raises :class:`HandoffError`, one line naming
  the step, the transfer and the peer process.

Small host values (a step's metrics, a version number) go through the key-value store as bytes
(:meth:`Channel.send_bytes`). A process that dies or stalls is also noticed by the others' watchdogs
(parallel/watchdog.py), usually sooner than a deadline here; each wait names itself to the watchdog.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from rlhf_jax.parallel import watchdog

PREFIX = "rlhf_jax/handoff"


class HandoffError(RuntimeError):
    """A transfer between process groups missed its deadline, or its two sides disagree; the message is one line."""


Index = tuple[tuple[int, int], ...]  # per dimension (start, stop) in global coordinates


@dataclasses.dataclass(frozen=True)
class Piece:
    """Of leaf ``leaf``: the block ``region`` (global coordinates) from the source shard on ``src`` to ``dst``,
    which holds the block ``dst_block``."""

    leaf: int
    src: int  # device id
    dst: int  # device id
    region: Index
    dst_block: Index

    def src_slices(self, src_block: Index) -> tuple[slice, ...]:
        return tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(self.region, src_block))

    def dst_slices(self) -> tuple[slice, ...]:
        return tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(self.region, self.dst_block))


def blocks_of(sharding, shape: tuple[int, ...]) -> dict[int, Index]:
    """Device id -> the block (global coordinates) it holds of an array of ``shape`` under ``sharding``."""
    out = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        out[device.id] = tuple((s.start or 0, shape[d] if s.stop is None else s.stop) if isinstance(s, slice)
                               else (s, s + 1) for d, s in enumerate(index))
    return out


def _overlap(a: Index, b: Index) -> Index | None:
    region = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return region if all(lo < hi for lo, hi in region) or not region else None


def transfer_plan(src_like: Any, dst_like: Any) -> list[Piece]:
    """The pieces that move leaves laid out as ``src_like`` (a pytree of ``jax.ShapeDtypeStruct`` with shardings)
    into the layout of ``dst_like`` (same tree, shapes and dtypes): each destination block is covered once, from
    the source shard of the lowest device id that holds each part of it (replicas are read once)."""
    src_leaves, src_tree = jax.tree.flatten(src_like)
    dst_leaves, dst_tree = jax.tree.flatten(dst_like)
    if src_tree != dst_tree:
        raise HandoffError(f"the two sides of a transfer hold different trees: {src_tree} vs {dst_tree}")
    pieces = []
    for leaf, (s, d) in enumerate(zip(src_leaves, dst_leaves)):
        if tuple(s.shape) != tuple(d.shape) or np.dtype(s.dtype) != np.dtype(d.dtype):
            raise HandoffError(f"leaf {leaf} of a transfer is {s.dtype}{list(s.shape)} on one side and "
                               f"{d.dtype}{list(d.shape)} on the other")
        sources = blocks_of(s.sharding, s.shape)
        for dst, block in sorted(blocks_of(d.sharding, d.shape).items()):
            covered: list[Index] = []
            for src in sorted(sources):
                region = _overlap(sources[src], block)
                if region is None or any(_overlap(region, c) is not None for c in covered):
                    continue  # a replica of a part already taken (shards of one layout never partly overlap)
                covered.append(region)
                pieces.append(Piece(leaf, src, dst, region, block))
    return pieces


def plan_digest(pieces: Sequence[Piece]) -> str:
    return hashlib.blake2b(repr(pieces).encode(), digest_size=8).hexdigest()


def _uuid(name: str, step: int, src_process: int, dst_device: int) -> int:
    digest = hashlib.blake2b(f"{name}|{step}|{src_process}|{dst_device}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Channel:
    """This process's end of the hand-offs between the processes of ``senders`` and ``receivers`` (process
    indices); ``deadline_s`` bounds every wait. One per process: it starts the transfer server."""

    def __init__(self, *, deadline_s: float, client=None, server=None):
        from jax._src import distributed

        self.deadline_s = float(deadline_s)
        self.client = client if client is not None else distributed.global_state.client
        if self.client is None:
            raise HandoffError("hand-offs between processes need jax.distributed to be initialized")
        self.process = jax.process_index()
        if server is None:
            from jax.experimental import transfer

            host = reachable_address(distributed.global_state.coordinator_address or "")
            where = f"[{host}]:0" if ":" in host else f"{host}:0"
            server = transfer.start_transfer_server(jax.local_devices()[0].client, where, [where])
        self.server = server
        self.client.key_value_set(f"{PREFIX}/address/{self.process}", self.server.address())
        self._connections: dict[int, Any] = {}
        self._offered: dict[tuple[str, int], list] = {}  # arrays offered and not yet known to be pulled

    # -- arrays ---------------------------------------------------------------------------------------------
    def send(self, name: str, step: int, tree: Any, dst_like: Any, receivers: Sequence[int]) -> None:
        """Offer this process's shards of ``tree`` to ``receivers``, who want it laid out as ``dst_like``; returns
        at once (the pulls happen on the receivers' side). The offers of this ``name`` at earlier steps are
        released."""
        pieces = transfer_plan(_like(tree), dst_like)
        leaves = jax.tree.leaves(tree)
        shards = [{s.device.id: s.data for s in leaf.addressable_shards} for leaf in leaves]
        blocks = [blocks_of(leaf.sharding, leaf.shape) for leaf in leaves]
        by_dst: dict[int, list] = {}
        for p in pieces:  # in plan order: the receiver lists its specs in the same order
            data = shards[p.leaf].get(p.src)
            if data is None:
                continue  # another sender's shard
            whole = p.region == blocks[p.leaf][p.src]
            by_dst.setdefault(p.dst, []).append(data if whole else data[p.src_slices(blocks[p.leaf][p.src])])
        for dst, arrays in sorted(by_dst.items()):
            self.server.await_pull(_uuid(name, step, self.process, dst), arrays)
        self._offered = {k: v for k, v in self._offered.items() if k[0] != name}
        self._offered[(name, step)] = [a for arrays in by_dst.values() for a in arrays]
        digest = plan_digest(pieces)
        for r in receivers:
            self.client.key_value_set(f"{PREFIX}/{name}/{step}/{self.process}->{r}", digest)

    def receive(self, name: str, step: int, src_like: Any, dst_like: Any, senders: Sequence[int]) -> Any:
        """``name`` of ``step`` from the processes ``senders``, laid out as ``dst_like`` on this process's
        devices; raises :class:`HandoffError` when a sender is not ready, or its pulls have not completed, within
        the deadline."""
        with watchdog.doing(f"step {step}: receiving {name} from process {', '.join(map(str, senders))}"):
            return self._receive(name, step, src_like, dst_like, senders)

    def _receive(self, name: str, step: int, src_like: Any, dst_like: Any, senders: Sequence[int]) -> Any:
        start = time.monotonic()
        pieces = transfer_plan(src_like, dst_like)
        digest = plan_digest(pieces)
        for sender in senders:
            key = f"{PREFIX}/{name}/{step}/{sender}->{self.process}"
            theirs = self._wait(key, start, f"step {step}: {name} not offered by process {sender}")
            self.client.key_value_delete(key)
            if theirs != digest:
                raise HandoffError(f"step {step}: {name} from process {sender}: the two sides planned different "
                                   "layouts (both must build the same source and destination shardings)")
        local = {d.id: d for d in jax.local_devices()}
        src_leaves = jax.tree.leaves(src_like)
        owner = {d.id: d.process_index for leaf in src_leaves for d in leaf.sharding.device_set}
        wanted: dict[tuple[int, int], list[Piece]] = {}
        for p in pieces:
            if p.dst in local:
                wanted.setdefault((owner[p.src], p.dst), []).append(p)

        current = {"sender": senders[0] if senders else None}

        def pull_all():
            got = {}
            for (sender, dst), ps in sorted(wanted.items()):
                current["sender"] = sender
                device = jax.sharding.SingleDeviceSharding(local[dst])
                specs = [jax.ShapeDtypeStruct(tuple(b - a for a, b in p.region), src_leaves[p.leaf].dtype,
                                              sharding=device) for p in ps]
                try:
                    arrays = self._connection(sender, start, name, step).pull(_uuid(name, step, sender, dst), specs)
                    jax.block_until_ready(arrays)
                except HandoffError:
                    raise
                except Exception as e:  # the peer went away mid-transfer (the transfer library's socket error)
                    raise self._late(f"step {step}: {name} from process {sender} failed", e) from None
                got.update(zip(ps, arrays))
            return got

        got = self._bounded(pull_all, start, lambda: f"step {step}: {name} from process {current['sender']} "
                            "not complete")
        return _assemble(dst_like, pieces, got, local)

    # -- host bytes -----------------------------------------------------------------------------------------
    def send_bytes(self, name: str, step: int, data: bytes, receivers: Sequence[int]) -> None:
        for r in receivers:
            self.client.key_value_set_bytes(f"{PREFIX}/bytes/{name}/{step}/{self.process}->{r}", data)

    def receive_bytes(self, name: str, step: int, sender: int) -> bytes:
        key = f"{PREFIX}/bytes/{name}/{step}/{sender}->{self.process}"
        start = time.monotonic()
        remaining = self._remaining(start, f"step {step}: {name} not sent by process {sender}")
        try:
            with watchdog.doing(f"step {step}: waiting for {name} from process {sender}"):
                data = self.client.blocking_key_value_get_bytes(key, remaining)
        except Exception as e:  # the runtime's DEADLINE_EXCEEDED (an XlaRuntimeError)
            raise self._late(f"step {step}: {name} not sent by process {sender}", e) from None
        self.client.key_value_delete(key)
        return data

    def poll_bytes(self, name: str, step: int, sender: int) -> bytes | None:
        """``receive_bytes`` if ``sender`` has sent it already, else None at once."""
        key = f"{PREFIX}/bytes/{name}/{step}/{sender}->{self.process}"
        try:
            data = self.client.key_value_try_get_bytes(key)
        except Exception as e:  # the runtime says NOT_FOUND for a key not set yet
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise self._late(f"step {step}: {name} from process {sender}", e) from None
        self.client.key_value_delete(key)
        return data

    # -- internals ------------------------------------------------------------------------------------------
    def _remaining(self, start: float, what: str) -> int:
        left = self.deadline_s - (time.monotonic() - start)
        if left <= 0:
            raise HandoffError(f"{what} within {self.deadline_s:g} s")
        return max(1, int(left * 1000))

    def _late(self, what: str, error: Exception) -> HandoffError:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        if "DEADLINE_EXCEEDED" in reason or "timed out" in reason.lower():
            return HandoffError(f"{what} within {self.deadline_s:g} s")
        return HandoffError(f"{what}: {reason}")

    def _wait(self, key: str, start: float, what: str) -> str:
        try:
            return self.client.blocking_key_value_get(key, self._remaining(start, what))
        except HandoffError:
            raise
        except Exception as e:
            raise self._late(what, e) from None

    def _connection(self, process: int, start: float, name: str, step: int):
        if process not in self._connections:
            address = self._wait(f"{PREFIX}/address/{process}", start,
                                 f"step {step}: {name}: process {process}'s transfer server is not known")
            self._connections[process] = self.server.connect(address)
        return self._connections[process]

    def _bounded(self, fn, start: float, what):
        """``fn()`` in a worker thread, waited for until the deadline: a pull from a peer that stalls never
        returns, and the caller must be able to stop. ``what()`` names what was late."""
        out: dict[str, Any] = {}

        def run():
            try:
                out["value"] = fn()
            except BaseException as e:  # handed to the caller below
                out["error"] = e

        worker = threading.Thread(target=run, name="rlhf_jax-handoff", daemon=True)
        worker.start()
        worker.join(max(0.0, self.deadline_s - (time.monotonic() - start)))
        if worker.is_alive():
            raise HandoffError(f"{what()} within {self.deadline_s:g} s")
        if "error" in out:
            error = out["error"]
            raise error if isinstance(error, HandoffError) else self._late(what(), error)
        return out["value"]


def reachable_address(coordinator: str) -> str:
    """This host's address on the network that reaches the coordinator (``host:port``): what the other processes
    can connect to (loopback when the coordinator is on this host, as in a rehearsal on 127.0.0.1)."""
    import socket

    host = coordinator.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _like(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _assemble(dst_like: Any, pieces: Sequence[Piece], got: dict, local: dict) -> Any:
    """The destination arrays from the pulled blocks: a block that arrived whole is used as it is, others are
    stitched on their device."""
    leaves, tree = jax.tree.flatten(dst_like)
    by_leaf: dict[int, dict[int, list[Piece]]] = {}
    for p in pieces:
        if p.dst in local:
            by_leaf.setdefault(p.leaf, {}).setdefault(p.dst, []).append(p)
    out = []
    for i, like in enumerate(leaves):
        blocks = []
        for dst, ps in sorted(by_leaf.get(i, {}).items()):
            if len(ps) == 1 and ps[0].region == ps[0].dst_block:
                blocks.append(got[ps[0]])
                continue
            shape = tuple(b - a for a, b in ps[0].dst_block)
            block = jax.device_put(np.zeros(shape, like.dtype), local[dst])
            for p in ps:
                block = block.at[p.dst_slices()].set(got[p])
            blocks.append(block)
        out.append(jax.make_array_from_single_device_arrays(tuple(like.shape), like.sharding, blocks))
    return jax.tree.unflatten(tree, out)
