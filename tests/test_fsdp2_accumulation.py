"""torch's FSDP2 accumulating k micro-batches, its bytes counted by the course's ledger
(expert finding 1 of issue 35): gradient sync off alone is not "unsharded" accumulation.

One launch of zero_lab/workers/knob_accumulation.py --only fsdp2 on 2 gloo ranks: FSDP2
(`fully_shard` on each Linear, then the root) at k = 1 and 4 in its four layouts (reshard
after forward or not x after the k - 1 unsynced backwards or not). Linear(15, 15): FSDP2
pads each parameter's dim 0 to a multiple of N, so Ψ is the padded bytes.
"""

from __future__ import annotations

import copy

import pytest

from zero_lab.grading import nb08_knobs_accumulation as nb08
from zero_lab.launch import torchrun
from zero_lab.launch.paths import WORKERS
from zero_lab.predict.knobs import fsdp2_accumulation_messages

N, WIDTH, DEPTH, K = 2, 15, 2, 4
PSI = DEPTH * (16 * WIDTH + 16) * 4  # weight 15 x 15 and bias 15, dim 0 padded to 16; fp32


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    result = torchrun(WORKERS / "knob_accumulation.py", nproc=N, backend="gloo", timeout=300,
                      stream=False,
                      args=["--only", "fsdp2", "--width", WIDTH, "--depth", DEPTH,
                            "--batch", 8, "--steps", 1, "--ks", 1, K])
    return [rep for rep in result.ranks]


def _volume_in_psi(report: dict, label: str, k: int) -> float:
    run = next(r for r in report["fsdp2"] if r["label"] == label and r["k"] == k)
    return sum(s["volume"] for s in run["comm"].values()) / run["psi_bytes"]


def test_fsdp2_bytes_equal_the_formula_in_every_layout(reports):
    for rep in reports:
        assert nb08.check_fsdp2_bytes_match_formula(rep) == 8  # 4 layouts x k = 1, 4
        assert {r["psi_bytes"] for r in rep["fsdp2"]} == {PSI}


def test_unsharded_accumulation_needs_reshard_after_backward_off(reports):
    """What the ledger measured at k = 4, read directly: with reshard_after_forward=False,
    gradient sync off alone gathers in every forward, (k+1)Ψ; with
    set_reshard_after_backward(False) too, one gather per optimizer step, 2Ψ (DDP's bytes).
    FSDP2's defaults (reshard after forward) gather twice per micro-batch, (2k+1)Ψ."""
    for rep in reports:
        assert _volume_in_psi(rep, "FSDP2 reshard bwd", K) == K + 1
        assert _volume_in_psi(rep, "FSDP2 reshard neither", K) == 2
        assert _volume_in_psi(rep, "FSDP2 reshard fwd + bwd", K) == 2 * K + 1
        assert _volume_in_psi(rep, "FSDP2 reshard fwd", K) == K + 2
        for label in ("FSDP2 reshard bwd", "FSDP2 reshard neither"):
            assert _volume_in_psi(rep, label, 1) == 2


def test_fsdp2_trains_to_one_process_in_every_layout(reports):
    for rep in reports:
        assert nb08.check_equal_to_one_process(rep, atol=1e-6) <= 1e-6


def test_fsdp2_check_rejects_a_regather_the_formula_does_not_count(reports):
    """Mutant of the report: the 2Ψ layout measured as if it re-gathered every micro-batch."""
    bad = copy.deepcopy(reports[0])
    runs = {(r["label"], r["k"]): r for r in bad["fsdp2"]}
    runs["FSDP2 reshard neither", K]["comm"] = runs["FSDP2 reshard bwd", K]["comm"]
    with pytest.raises(AssertionError, match="FSDP2 reshard neither"):
        nb08.check_fsdp2_bytes_match_formula(bad)


def test_fsdp2_formula_counts_per_group():
    messages = fsdp2_accumulation_messages(100, 3, 2, n_groups=5, reshard_after_forward=False)
    assert messages["all_gather"]["count"] == 15 and messages["all_gather"]["nbytes"] == 300
    assert messages["reduce_scatter"]["count"] == 5 and messages["reduce_scatter"]["nbytes"] == 100
    assert fsdp2_accumulation_messages(100, 3, 1) == {}  # one rank: FSDP2 sends nothing
