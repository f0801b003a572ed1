"""Shared by the tests of the case workers: one launch per (worker, world size), cached for
the whole test session (each launch costs seconds before a rank runs anything).

test_collectives.py, test_partition.py, test_stages.py, test_zero3.py, test_contract.py,
test_contract_habits.py and test_stage3_reads.py read their parts of one launch per world size
of tests/workers/world_cases.py (`case_reports`). The launch tests share `alive(pid)`."""

from __future__ import annotations

from pathlib import Path

from zero_lab.launch import torchrun
from zero_lab.launch.paths import REPO_ROOT

WORLD_CASES = REPO_ROOT / "tests" / "workers" / "world_cases.py"
WORLD_SIZES = (1, 2, 3)  # of stages 0-3 (tests/workers/world_cases.py)

_launched: dict[tuple[Path, int], tuple[dict, ...] | Exception] = {}


def worker_reports(worker: Path, nproc: int) -> tuple[dict, ...]:
    """Every rank's report from one launch of a case worker on `nproc` gloo ranks, launched
    once per (worker, nproc) for the whole test session. A launch that failed is not retried:
    every test that reads it fails with the same error (its rank's traceback)."""
    key = (Path(worker), nproc)
    if key not in _launched:
        try:
            result = torchrun(worker, nproc=nproc, timeout=600, stream=False, backend="gloo")
            _launched[key] = tuple(result.ranks)
        except Exception as exc:  # noqa: BLE001 - kept, and raised again to every reader
            _launched[key] = exc
    if isinstance(_launched[key], Exception):
        raise _launched[key]
    return _launched[key]


def case_reports(part: str, nproc: int) -> tuple[dict, ...]:
    """Every rank's report of `part` (a key of tests/workers/world_cases.py's PARTS, e.g.
    "stages") from the launch of world_cases.py on `nproc` gloo ranks that the parts share."""
    return tuple(rep[part] for rep in worker_reports(WORLD_CASES, nproc))


def finding_reports(part: str) -> tuple[dict, ...]:
    """Every rank's report of `part` (e.g. "frozen") of tests/workers/finding_cases.py, run in
    the launch of world_cases.py on 2 gloo ranks."""
    return tuple(rep[part] for rep in case_reports("findings", 2))


def stage_case_reports(nproc: int) -> tuple[dict, ...]:
    """Every rank's report from tests/workers/stage_cases.py run on `nproc` gloo ranks."""
    return case_reports("stages", nproc)


def select_cases(reports: tuple[dict, ...], rank: int = 0, **match) -> list[dict]:
    """The cases rank `rank` reported whose fields equal every `match` (e.g. precision="fp32")."""
    return [c for c in reports[rank]["cases"] if all(c[k] == v for k, v in match.items())]


def assert_every_rank_ran_every_case(reports: tuple[dict, ...], nproc: int, n_cases: int) -> None:
    """Each of the `nproc` ranks reported the same `n_cases` distinct cases, in one order."""
    assert len(reports) == nproc
    names = [c["name"] for c in reports[0]["cases"]]
    assert len(names) == len(set(names)) == n_cases
    assert all([c["name"] for c in rep["cases"]] == names for rep in reports)


def assert_losses_match_the_global_batch(reports: tuple[dict, ...], skip=lambda c: False) -> None:
    """Per case, the ranks' losses averaged = the one-process loss on the global batch
    (bf16 keeps 8 significant bits: a looser tolerance in mixed precision)."""
    import torch

    for i, c in enumerate(reports[0]["cases"]):
        if skip(c):
            continue
        mean = torch.tensor([rep["cases"][i]["losses"] for rep in reports]).mean(0)
        torch.testing.assert_close(mean, torch.tensor(c["ref_losses"]), rtol=_rtol(c), atol=0,
                                   msg=c["name"])


def assert_global_clip_norms(reports: tuple[dict, ...], clip_of) -> int:
    """Per clipped case: every rank returned the same norm, equal to the one-process norm on
    the global batch, and clipping (at `clip_of(case)`) was really active. Returns how many
    cases clipped, for the caller to check."""
    import torch

    clipped = [(i, c) for i, c in enumerate(reports[0]["cases"]) if c["grad_norms"]]
    for i, c in clipped:
        norms = torch.tensor([rep["cases"][i]["grad_norms"] for rep in reports])
        assert (norms == norms[0]).all(), f"{c['name']}: ranks disagree on the norm"
        torch.testing.assert_close(norms[0], torch.tensor(c["ref_grad_norms"]), rtol=_rtol(c),
                                   atol=0, msg=c["name"])
        assert max(c["ref_grad_norms"]) > clip_of(c), f"{c['name']}: clipping never active"
    return len(clipped)


def _rtol(case: dict) -> float:
    return 1e-5 if case["precision"] == "fp32" else 3e-2  # bf16 keeps 8 significant bits


# A script for a fresh process (its peak memory is its own): consolidate a checkpoint one
# tensor at a time; print how far the peak rose, the largest tensor and the total.
MEASURE_CONSOLIDATION = """
import json, resource, sys
from zero_lab import checkpoint

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

directory = sys.argv[1]
checkpoint.read_manifest(directory)
before = peak()
largest = total = 0
for name, tensor in checkpoint.iter_consolidated(directory, optimizer=True):
    largest, total = max(largest, tensor.nbytes), total + tensor.nbytes
    del tensor
print(json.dumps({"rise": peak() - before, "largest": largest, "total": total}))
"""


def alive(pid: int) -> bool:
    """Is `pid` running (a zombie, waiting to be reaped, counts as ended)? Linux: /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
