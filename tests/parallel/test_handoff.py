"""Hand-offs between process groups (rlhf_jax/parallel/handoff.py): the transfer plan against float64-free index
arithmetic in one process, then four processes over gloo (two send, two receive, tests/parallel/handoff_worker.py):
every layout arrives equal, and a sender that is late, stalls or dies makes each receiver stop within the deadline
with one line naming the step, the transfer and the process."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from rlhf_jax.parallel.handoff import HandoffError, blocks_of, transfer_plan
from tests.parallel.handoff_worker import layouts, value
from tests.parallel.rehearsal import rehearse

DEADLINE_S = 4


def _meshes(devices):
    return {"d": Mesh(np.array(devices), ("d",)), "rc": Mesh(np.array(devices).reshape(2, 2), ("r", "c"))}


@pytest.mark.parametrize("name", sorted(layouts()))
def test_the_plan_covers_every_destination_block_once_from_the_source_blocks(name):
    shape, dtype, (src_mesh, src_spec), (dst_mesh, dst_spec) = layouts()[name]
    src = _meshes(jax.devices()[:4])[src_mesh]
    dst = _meshes(jax.devices()[4:8])[dst_mesh]
    src_like = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(src, src_spec))
    dst_like = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(dst, dst_spec))
    pieces = transfer_plan(src_like, dst_like)
    whole = value(name, shape, dtype, step=1)
    src_blocks = blocks_of(src_like.sharding, shape)
    for device, index in dst_like.sharding.devices_indices_map(shape).items():
        block = np.full(whole[index].shape, -12345, dtype)
        filled = np.zeros(whole[index].shape, int)
        for p in (p for p in pieces if p.dst == device.id):
            source = whole[tuple(slice(a, b) for a, b in src_blocks[p.src])]  # the shard as its device holds it
            block[p.dst_slices()] = source[p.src_slices(src_blocks[p.src])]
            filled[p.dst_slices()] += 1
        np.testing.assert_array_equal(block, whole[index])
        assert (filled == 1).all(), f"{name}: device {device.id} gets some elements twice or never"


def test_the_two_sides_must_agree_on_shapes():
    mesh = _meshes(jax.devices()[:4])["d"]
    a = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, jax.sharding.PartitionSpec()))
    b = jax.ShapeDtypeStruct((8, 5), np.float32, sharding=NamedSharding(mesh, jax.sharding.PartitionSpec()))
    with pytest.raises(HandoffError, match=r"leaf 0 of a transfer is float32\[8, 4\] on one side and "
                                           r"float32\[8, 5\] on the other"):
        transfer_plan([a], [b])


def _rehearse(scenario: str):
    return rehearse("tests.parallel.handoff_worker", scenario, watch=(2, 3),
                    env={"HANDOFF_DEADLINE_S": str(DEADLINE_S)})


def test_four_processes_move_every_layout_between_the_groups():
    lines, _ = _rehearse("ok")
    for process in (2, 3):
        assert [r["step"] for r in lines[process]] == [1, 2], lines[process]
        for r in lines[process]:
            assert r["checks"] and all(r["checks"].values()), r
            assert r["meta"] == {"version": r["step"]}


@pytest.mark.parametrize("scenario, says", [
    ("late", r"step 2: weights not offered by process 0 within 4 s"),
    ("stalled", r"step 2: weights from process 1 not complete within 4 s"),
    ("killed", r"step 2: weights from process 1 failed: .+"),
])
def test_a_sender_that_is_late_stalls_or_dies_stops_each_receiver_with_one_line(scenario, says):
    import re

    lines, receivers_done = _rehearse(scenario)
    for process in (2, 3):
        first, second = lines[process]
        assert first["step"] == 1 and all(first["checks"].values())
        assert second["step"] == 2 and re.fullmatch(says, second["error"]), second
        assert "\n" not in second["error"] and second["waited_s"] <= DEADLINE_S + 1
    assert receivers_done < 60
