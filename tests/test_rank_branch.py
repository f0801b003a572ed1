"""A stage-3 branch that calls a unit on some ranks only (`if dist.get_rank() == 0: x =
self.extra(x)`) is named at that unit, on every rank, in the first forward: the launch fails
with that error instead of a timeout or a native abort inside gloo
(tests/workers/rank_branch.py runs the cases; its docstring says what each did before).
"""

from __future__ import annotations

import pytest

from zero_lab.launch import LaunchError, LaunchTimeout, torchrun
from zero_lab.launch.paths import REPO_ROOT

WORKER = REPO_ROOT / "tests" / "workers" / "rank_branch.py"
TIMEOUT = 180  # generous: the cases take seconds; a hang (the bug) runs into it
CAUSE = ("Look for a branch around a unit's call that depends on the rank "
         "(`if dist.get_rank() == 0:`) or on this rank's data")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N={n}")
def ranks(request) -> tuple[int, tuple[dict, ...]]:
    n = request.param
    result = torchrun(WORKER, nproc=n, args=["cases"], timeout=TIMEOUT, stream=False,
                      backend="gloo")
    return n, tuple(result.ranks)


def case(reports: tuple[dict, ...], name: str) -> list[tuple[int, dict]]:
    found = [(rank, c) for rank, rep in enumerate(reports) for c in rep["cases"]
             if c["name"] == name]
    assert len(found) == len(reports), name
    return found


def gathering(n: int, first: str, others: str) -> str:
    """The dict the error shows: what each rank gathers (rank 0 takes the branch)."""
    return str({r: first if r == 0 else others for r in range(n)})


def assert_named_in_the_first_forward(reports: tuple[dict, ...], name: str, others_do: str,
                                      others_gather: str, position: str) -> None:
    """Case `name` failed every rank in the first forward, with the check's error: rank 0
    (which takes the branch) gathers unit 'extra', the others `others_do`, at `position`."""
    n = len(reports)
    for rank, c in case(reports, name):
        assert c["where"] == "forward 0", (rank, c)
        mine = "gathers unit 'extra'" if rank == 0 else others_do
        assert c["error"].startswith(
            f"the ranks' forwards differ: rank {rank} {mine} while the ranks gather "
            f"{gathering(n, 'extra', others_gather)} ({position}). "), (rank, c["error"])
        assert CAUSE in c["error"], (rank, c["error"])


def test_a_rank_dependent_branch_fails_the_launch_with_the_unit_named():
    """The learner's script, nothing caught: the launch's error is the check's, naming the
    unit and what every rank was gathering, with the likely cause (not a LaunchTimeout)."""
    with pytest.raises(LaunchError) as raised:
        torchrun(WORKER, nproc=2, args=["learner"], timeout=TIMEOUT, stream=False,
                 backend="gloo")
    error = raised.value
    assert not isinstance(error, LaunchTimeout), str(error)
    assert error.rank in (0, 1)
    assert error.cause.startswith(
        f"rank {error.rank} of 2 failed in rank_branch.py: RuntimeError: the ranks' forwards "
        f"differ: rank {error.rank} gathers unit "
        f"{['extra', 'layers.2'][error.rank]!r} while the ranks gather "
        "{0: 'extra', 1: 'layers.2'} (all-gather 3 of the forward, after layers.0, "
        "layers.1)"), error.cause
    assert CAUSE in str(error)


@pytest.mark.parametrize("name", ["same_size", "smaller", "bigger"])
def test_a_unit_called_on_one_rank_only_is_named_before_its_all_gather(ranks, name):
    """Before layers.2, rank 0 calls `extra`: of the same size (its all-gather used to pair
    with layers.2's silently, then hang), smaller or bigger (gloo aborted a rank). Every rank
    raises in the first forward, at that all-gather, before any data is exchanged."""
    _, reports = ranks
    assert_named_in_the_first_forward(reports, name, "gathers unit 'layers.2'", "layers.2",
                                      "all-gather 3 of the forward, after layers.0, layers.1")


def test_a_unit_called_after_the_last_on_one_rank_is_named(ranks):
    """After the last layer, rank 0 calls `extra` while the others end their forward: its
    check meets their end-of-forward lockstep check (it used to hang there)."""
    _, reports = ranks
    assert_named_in_the_first_forward(
        reports, "after_the_last", "ended its forward", "(forward ended)",
        "all-gather 5 of the forward, after layers.0, layers.1, layers.2, layers.3")


def test_check_order_names_a_branch_that_first_runs_in_a_later_forward(ranks):
    """The default checks each all-gather of the first forward only (it learns the order
    there); a branch first taken in the second forward is named there with
    check_order=True, which checks every all-gather of every forward. From the second
    forward on, each unit prefetches the next: layers.2's all-gather started when layers.1
    did, so rank 0's `extra` meets the others' prefetch of layers.3."""
    n, reports = ranks
    for rank, c in case(reports, "later_check_order"):
        assert c["where"] == "forward 1", (rank, c)
        assert f"while the ranks gather {gathering(n, 'extra', 'layers.3')} " \
            "(all-gather 4 of the forward, after layers.0, layers.1, layers.2)" \
            in c["error"], (rank, c["error"])
        assert CAUSE in c["error"], (rank, c["error"])


def test_check_order_names_a_unit_called_after_the_last(ranks):
    """check_order's check is the same message as the default one (24 bytes a rank, the
    lockstep check's), so it too meets the others' end-of-forward check: before, its 8-byte
    all-gather met that 24-byte one and gloo aborted the rank."""
    n, reports = ranks
    for rank, c in case(reports, "after_the_last_check_order"):
        assert c["where"] == "forward 0", (rank, c)
        assert f"while the ranks gather {gathering(n, 'extra', '(forward ended)')}" \
            in c["error"], (rank, c["error"])


def test_only_the_first_forward_checks_each_all_gather_and_as_control(ranks):
    """The check's price: in the first step one 24-byte control message a rank before each
    unit's forward all-gather, besides the end-of-forward lockstep check; in every later step
    the lockstep check alone. The data the ledger records is the same in both steps."""
    n, reports = ranks
    for rep in reports:
        ledger = rep["ledger"]
        assert ledger["units"] == 4  # four layers (the root holds no parameter)
        first, second = ledger["control"]
        assert first == [["all_gather", 24 * n]] * (4 + 1), first
        assert second == [["all_gather", 24 * n]], second
        assert ledger["data"][0] == ledger["data"][1]
