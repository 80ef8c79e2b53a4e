"""Process groups (rlhf_jax/parallel/groups.py): four processes over gloo, one group or split in two; in a split
each group's host collectives (allgather, gather_all, sum_over_processes, to_global) run over its own processes
only, at the same time as the other group's."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlhf_jax.parallel import groups
from tests.parallel.rehearsal import rehearse


def _rows(process: int) -> list[list[float]]:
    return (np.arange(4, dtype=np.float32).reshape(2, 2) + 10 * process).tolist()


@pytest.mark.parametrize("scenario, members", [("one", {p: (0, 1, 2, 3) for p in range(4)}),
                                               ("split", {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)})])
def test_host_collectives_run_over_the_processes_of_the_group(scenario, members):
    lines, _ = rehearse("tests.parallel.groups_worker", scenario)
    for process, (line,) in lines.items():
        group = members[process]
        assert line["group"] == list(group)
        assert (line["index"], line["count"], line["devices"]) == (group.index(process), len(group), 2 * len(group))
        assert line["first"] == (process == group[0])
        assert line["gathered_values"] == [float(p) for p in group]
        assert line["gathered_rows"] == [row for p in group for row in _rows(p)]
        assert line["local_rows_back"]
        assert line["summed"] == [sum(group), len(group)]


def test_a_split_keeps_process_0_training_and_refuses_an_empty_side():
    training, sampling = groups.split(8, 3)
    assert training.processes == (0, 1, 2, 3, 4) and sampling.processes == (5, 6, 7)
    for k in (0, 8):
        with pytest.raises(ValueError, match=f"{k} sampling processes of 8: at least one process must sample and "
                                             "one train"):
            groups.split(8, k)


def test_one_process_is_a_group_of_one():
    assert groups.current().processes == (0,) and groups.process_count() == 1 and groups.process_index() == 0
    assert groups.device_count() == jax.device_count()
    np.testing.assert_array_equal(groups.allgather(np.arange(3)), [[0, 1, 2]])
