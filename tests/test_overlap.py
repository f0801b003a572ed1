"""shard()'s overlap options (stages/param_gather.py, InFlight in stages/partition.py), from
the "overlap" part of tests/workers/world_cases.py (tests/workers/overlap_cases.py): every
variant trains as one process on the global batch, bit for bit as its plain stage, sends the
same bytes per step, and every reader outside a forward waits for what is still in flight
(each reader's mutant, its waits switched off, reads something else)."""

from __future__ import annotations

import pytest
from common import case_reports

FP32_ATOL = 1e-6  # as tests/test_stages.py (Adam with eps 1e-6, lr 1e-3: measured ~2e-7)
READ_ATOL = 2e-5  # the readers' runs use lr 1e-2: float32 drift ~3e-6 (overlap_cases.py)
STALE = 3e-4  # a reader that did not wait is off by about a step of Adam (lr 1e-2; its next
#               forward's loss by ~7e-4)
PARAM_READERS = ("forward", "full_state_dict", "state_dict", "wait_for_params",
                 "checkpoint_load")
GRAD_READERS = ("clip_grad_norm_", "wait_for_grads")
RAW_READS = ("sum", "clone", "equal", "detach")  # of model[0].weight, nothing waited before


@pytest.fixture(scope="module", params=(2, 3, 4))
def reports(request):
    return request.param, case_reports("overlap", request.param)


def plain_of(variant: str) -> str:
    return variant.split("_")[0]  # "stage1_all" -> "stage1"


def test_every_variant_trains_as_one_process_and_as_its_plain_stage(reports):
    n, reps = reports
    cases = reps[0]["cases"]
    assert len(cases) == (28 if n == 2 else 8)
    plain = {(c["variant"], c["config"]): c for c in cases}
    for c in cases:
        if c["config"] != "bf16":  # bf16: the plain stage's own test bounds its drift
            assert c["max_abs_diff"] <= FP32_ATOL, (n, c["variant"], c["config"], c)
        assert c["digest"] == plain[plain_of(c["variant"]), c["config"]]["digest"], \
            (n, c["variant"], c["config"])
    for rep in reps:  # every rank holds the same weights
        assert [c["digest"] for c in rep["cases"]] == [c["digest"] for c in cases]


def test_bytes_per_step_are_the_plain_stages(reports):
    n, reps = reports
    cases = reps[0]["cases"]
    plain = {(c["variant"], c["config"]): c for c in cases}
    for c in cases:
        assert c["ledger"] == plain[plain_of(c["variant"]), c["config"]]["ledger"], \
            (n, c["variant"], c["config"])
        assert {"reduce_scatter", "all_gather"} <= set(c["ledger"]), c["variant"]


def test_every_reader_waits_for_the_collectives_in_flight():
    readers = case_reports("overlap", 2)[0]["readers"]
    for variant in ("stage1_param_gather", "stage2_param_gather"):
        _assert_waits(readers, variant, PARAM_READERS)
        assert readers[variant]["step_again"] <= READ_ATOL, variant
    for variant in ("stage1_all", "stage2_all"):
        _assert_waits(readers, variant, GRAD_READERS)
        assert readers[variant]["checkpoint_save"] <= READ_ATOL, variant


def _assert_waits(readers: dict, variant: str, names) -> None:
    """Each reader of `variant` read the one-process value; its mutant (waits off) did not."""
    right, mutant = readers[variant], readers[f"{variant}-mutant"]
    for reader in names:
        assert right[reader] <= READ_ATOL, (variant, reader, right[reader])
        assert mutant[reader] > STALE, (variant, reader, "the mutant read right")


def test_a_raw_read_of_a_parameter_in_flight_waits_for_its_bucket():
    """stages/param_gather.py's flag, "in flight": no stale read without wait_for_params()."""
    readers = case_reports("overlap", 2)[0]["readers"]
    for variant in ("stage1_param_gather", "stage2_param_gather"):
        right, mutant = readers[f"{variant}-raw"], readers[f"{variant}-raw-mutant"]
        for read in RAW_READS:
            assert right[read] <= READ_ATOL, (variant, read, right[read])
            assert mutant[read] > STALE, (variant, read, "the mutant read right")
        assert right["states_after_step"] == ["in flight"], right
        assert right["state_after_read"] == "whole"
        # the read waited for its own bucket (the first layer's, issued first) only
        assert right["in_flight_after_read"] == right["buckets_in_flight"] - 1 > 0, right
        assert right["states_after_forward"] == ["whole"], right


def test_a_model_dropped_in_flight_finishes_its_messages_first():
    """Dropped with collectives in flight (collectives/exchange.py: Exchange.__del__ waits),
    the launch goes on: a later all-reduce and a second model train right. Without the wait
    the launch hangs or a rank's heap is corrupted (a receive landing in freed memory)."""
    reps = case_reports("overlap", 2)
    plain = {(c["variant"], c["config"]): c for c in reps[0]["cases"]}
    for rank, rep in enumerate(reps):
        dropped = rep["dropped"]
        if rank < len(reps) - 1:  # the ranks that dropped first had messages in flight
            assert all(n > 0 for n in dropped["in_flight"].values()), dropped["in_flight"]
        assert dropped["all_reduce"] == sum(range(len(reps)))
        for c in dropped["after"]:
            assert c["max_abs_diff"] <= FP32_ATOL, c
            assert c["digest"] == plain[c["variant"], c["config"]]["digest"], c["variant"]
