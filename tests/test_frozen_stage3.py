"""Stage 3 shards frozen parameters too (issue 35, finding 15), as FSDP2 does: for LoRA-style
fine-tuning the frozen base is most of the memory.

A LoRA-like model (tests/workers/masters_frozen_cases.py's LoRANet, d = 33: two blocks of a
frozen Linear(33, 33) base plus a trainable rank-2 adapter, a frozen Linear(33, 33) at the
root beside a trainable gain, a trainable head), stage 3 on 2 gloo ranks, 3 steps of Adam:
- at rest each rank holds ceil(1122 / 2) = 561 elements (2,244 bytes in fp32) of each frozen
  Linear (weight and bias, 1,122 elements), not 1,122;
- the weights equal one process's on the global batch (fp32 tolerance), the frozen ones
  unchanged;
- one step's all-gathers carry the frozen parameters (twice a unit: forward and backward)
  and its reduce-scatters do not (no gradient, no optimizer state);
- zero_lab.checkpoint saves them whole and loads each rank's piece back, as
  model.load_state_dict of the full weights does.
In the launch of world_cases.py on 2 ranks, with tests/test_precision_masters.py's cases.
"""

from __future__ import annotations

import math

import pytest
from common import case_reports

N = 2
D = 33
FROZEN = D * D + D  # a frozen Linear(33, 33): weight and bias
TRAINABLE = {"blocks.0": 2 * D + D * 2, "blocks.1": 2 * D + D * 2, "head": D * 3 + 3,
             "(root)": D}  # adapters a and b; the head; the root's gain


def padded(numel: int) -> int:
    return math.ceil(numel / N) * N


@pytest.fixture(scope="module")
def reports() -> tuple[dict, ...]:
    return tuple(rep["frozen_stage3"] for rep in case_reports("masters_frozen", N))


def test_frozen_parameters_rest_as_slices(reports):
    for rep in reports:
        assert rep["frozen_numel"] == {"proj": FROZEN, "blocks.0.base": FROZEN,
                                       "blocks.1.base": FROZEN}
        for module, nbytes in rep["at_rest"].items():
            assert nbytes == math.ceil(FROZEN / N) * 4, (
                f"{module}: {nbytes} bytes at rest on this rank, not its slice of "
                f"ceil({FROZEN}/{N}) fp32 elements")
        assert rep["gathered_after"] == 0  # nothing left gathered after the step


def test_training_with_sharded_frozen_parameters_equals_one_process(reports):
    for rep in reports:
        assert rep["max_diff"] < 1e-5, rep["max_diff"]
        assert rep["frozen_unchanged"]


def test_a_checkpoint_holds_the_frozen_parameters_whole(reports):
    """zero_lab.checkpoint.save writes each sharded frozen parameter whole; load gives each
    rank its piece back (into a model initialised otherwise); consolidate has it whole."""
    for rep in reports:
        assert rep["checkpoint_exact"] and rep["consolidated_exact"]


def test_load_state_dict_of_the_full_weights_gives_each_rank_its_frozen_pieces(reports):
    """model.load_state_dict(W) at stage 3: torch copies this rank's piece of each frozen
    parameter too (a full one would not fit its 1-D piece), into a model initialised
    otherwise."""
    for rep in reports:
        assert rep["load_state_dict_exact"]


def test_gathers_carry_the_frozen_parameters_and_reduce_scatters_do_not(reports):
    units = {u["unit"]: u for u in reports[0]["units"]}
    assert {u: units[u]["frozen_numel"] for u in units} == {
        "blocks.0": FROZEN, "blocks.1": FROZEN, "head": 0, "(root)": FROZEN}
    gathers = sorted([padded(n) for n in TRAINABLE.values()] * 2 + [padded(FROZEN)] * 6)
    scatters = sorted(padded(n) for n in TRAINABLE.values())
    for rep in reports:
        ledger = rep["ledger"]
        assert sorted(n for op, _, n in ledger if op == "all_gather") == gathers
        assert sorted(n for op, _, n in ledger if op == "reduce_scatter") == scatters
        assert {op for op, _, _ in ledger} == {"all_gather", "reduce_scatter"}
