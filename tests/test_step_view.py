"""The step view (zero_lab/course/step_record.py on the ranks, step_view.py drawing it): one
step of DDP and ZeRO stages 1-3 recorded on 2 and 3 gloo ranks (a part of
tests/workers/world_cases.py's launch), and the grids drawn from it.

Mutants: stage 2 keeping the full gradient after its reduce-scatter (the held gradient
test fails); a slice stepped with the local gradient instead of the averaged one (the final
parameters differ from DDP's); Next not stopping at the last phase."""

from __future__ import annotations

import pytest
from common import case_reports

from zero_lab.course import step_view

SYSTEMS = ("ddp", "stage1", "stage2", "stage3")


@pytest.fixture(scope="module", params=(2, 3), ids=lambda n: f"N={n}")
def records(request) -> list[dict]:
    return list(case_reports("step_record", request.param))


def test_every_system_ends_on_ddps_parameters_on_every_rank(records):
    for rank in records:
        for system in SYSTEMS:
            assert rank["final_params"][system] == records[0]["final_params"]["ddp"], system


def test_the_reduce_scatter_leaves_each_rank_the_average_of_its_own_slice(records):
    ddp = step_view.phase_grid(records, "ddp", 1)  # after the all-reduce: the average
    for system in ("stage1", "stage2"):
        grid = step_view.phase_grid(records, system, 1)
        for r, rank in enumerate(records):
            lo, hi = rank["systems"][system][1]["owned"]
            row = grid[3 * r + 1]
            assert [v for v, _ in row[lo:hi]] == [v for v, _ in ddp[3 * r + 1][lo:hi]]
            assert {key for _, key in row[lo:hi]} == {"mean"}
            outside = [v for v, _ in row[:lo] + row[hi:]]
            if system == "stage1":  # stage 1 keeps its own full gradient until the step
                assert None not in outside and {k for _, k in row[:lo] + row[hi:]} == {"local"}
            else:  # stage 2 frees it once sent
                assert set(outside) == {None}


def test_held_bytes_fall_stage_by_stage_and_stage2_peaks_as_stage1_does(records):
    n, padded = len(records), records[0]["padded"]
    shard = padded // n

    def peak(system):
        return max(max(step_view.held_bytes(records, system, p))
                   for p in range(len(step_view.phases(records, system))))

    assert peak("ddp") == 3 * padded * 8  # parameters, gradient, Adam m: all of them
    assert peak("stage1") == peak("stage2") == (2 * padded + shard) * 8
    # stage 3 at its peak: its slices of the parameters and Adam m, the full gradient
    assert peak("stage3") == (padded + 2 * shard) * 8 < peak("stage1")
    at_rest = step_view.held_bytes(records, "stage3", 0)
    assert at_rest == [2 * shard * 8] * n  # its slice of the parameters and of Adam m


def test_the_messages_are_the_ledgers_bytes(records):
    n, nbytes = len(records), records[0]["padded"] * 8
    sent = {s: [p["message"] for p in records[0]["systems"][s] if p["message"]]
            for s in SYSTEMS}
    assert sent["ddp"] == [{"op": "all_reduce", "sent": 2 * (n - 1) * nbytes // n}]
    one_way = (n - 1) * nbytes // n
    assert [m["op"] for m in sent["stage1"]] == ["reduce_scatter", "all_gather"]
    assert sum(m["sent"] for m in sent["stage1"]) == sent["ddp"][0]["sent"] == 2 * one_way
    assert [m["op"] for m in sent["stage3"]] == ["all_gather", "reduce_scatter"]


def test_the_view_steps_through_the_phases_and_restarts_on_another_system(records):
    box = step_view.step_view(records, "stage1")
    assert box.back.disabled and "phase 1:" in box.title.value
    for _ in range(10):  # past the end: it stops at the last phase
        box.forward.click()
    assert box.forward.disabled and "phase 4: all-gather" in box.title.value
    box.picker.value = "stage3"
    assert box.back.disabled and "ZeRO-3, phase 1: at rest" in box.title.value
    assert bytes(box.image.value[:4]) == b"\x89PNG"


def test_bad_input_is_named(records):
    with pytest.raises(ValueError, match="system 'stage4' is not recorded"):
        step_view.phases(records, "stage4")
    with pytest.raises(ValueError, match="phase must be 0..3 for stage1, got 4"):
        step_view.phase_grid(records, "stage1", 4)
