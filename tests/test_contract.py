"""The edges of the contract torch's DDP, ZeroRedundancyOptimizer and FSDP2 honour, at every
stage, against one process (tests/workers/contract_cases.py, in the launch per world size
of tests/workers/world_cases.py).

- a parameter with no gradient in a step keeps `.grad` None and is not stepped (AdamW does
  not decay it, Adam does not move it), whether no rank or only some ranks used it;
- zero_grad(set_to_none=True/False), model.zero_grad() and an opt.step() with no backward
  since the last zero_grad do what they do in one process;
- parameter groups with their own settings apply to exactly their parameters; an LR
  scheduler steps them.
"""

from __future__ import annotations

import pytest
from common import case_reports

FP32_ATOL = 1e-6  # fp32 weights of size ~0.1-1 after 6 steps (the stage tests measure 1.2e-7)


@pytest.fixture(params=[2, 3], scope="module", ids=lambda n: f"N={n}")
def ranks(request):
    return request.param, case_reports("contract", request.param)


def cases(ranks, scenario: str) -> list[tuple[int, dict]]:
    _, reps = ranks
    return [(r, c) for r, rep in enumerate(reps) for c in rep["cases"]
            if c["scenario"] == scenario]


@pytest.mark.parametrize("scenario", ["unused", "rank_usage", "zero_grad", "groups",
                                      "root_replicate"])
def test_trains_as_one_process(ranks, scenario):
    found = cases(ranks, scenario)
    assert {c["stage"] for _, c in found} >= ({3} if scenario == "root_replicate" else {0, 1, 2})
    for rank, c in found:
        assert c["max_abs_diff"] <= FP32_ATOL, (c["name"], rank, c["worst_key"],
                                                c["max_abs_diff"])


def test_a_parameter_no_step_uses_is_left_alone(ranks):
    for rank, c in cases(ranks, "unused"):
        assert c["moved"]["spare.weight"] == 0.0  # one process: AdamW never touches it
        assert c["moved_here"]["spare.weight"] == 0.0, (c["name"], rank)
        assert c["moved"]["sometimes.weight"] > 0  # used on even steps: it trains


def test_grad_is_none_where_one_process_has_none(ranks):
    """Stages 0, 1 and 3 show gradients on the parameters (stage 3: this rank's pieces);
    stage 2 keeps none there by design (only the owned slices), so its .grad is always None."""
    for scenario in ("unused", "zero_grad"):
        for rank, c in cases(ranks, scenario):
            if c["stage"] == 2:
                assert all(all(step) for step in c["seen"]["grad_none"]), (c["name"], rank)
            else:
                assert c["seen"]["grad_none"] == c["ref_seen"]["grad_none"], (c["name"], rank)


def test_groups_keep_their_settings_and_the_scheduler_steps_them(ranks):
    for rank, c in cases(ranks, "groups"):
        assert c["seen"] == c["ref_seen"], (c["name"], rank)
        assert c["seen"]["decays"] == [0.2, 0.0]
        assert c["seen"]["lrs"] == pytest.approx([2e-2 / 8, 5e-3 / 8])  # 3 halvings


def test_an_unused_parameter_is_refused_unless_asked_for(ranks):
    _, reps = ranks
    for rank, rep in enumerate(reps):
        for stage, message in rep["refused"].items():
            assert message.startswith(
                f"2 trainable parameter(s) got no gradient in this backward on rank {rank}: "
                "spare.bias, spare.weight. If the model really leaves parameters unused"), stage
            assert "find_unused_parameters=True" in message


def test_ranks_that_disagree_fail_together(ranks):
    """Different stages, or models with the same element count and other shapes: refused
    by every rank at shard(); stage 3 units run in a rank-dependent order: refused at the
    first gather with check_order=True."""
    _, reps = ranks
    for rep in reps:
        found = rep["disagree"]
        assert found["stage"] == (
            "ValueError: the ranks called shard() differently: rank 1 has stage = 2 where "
            "rank 0 has 1. Every rank must shard the same model (same parameter names and "
            "shapes) with the same settings")
        assert found["shapes"] == (
            "ValueError: the ranks called shard() differently: rank 1 has parameters[0] = "
            "('weight', (4, 6), 'torch.float32', True) where rank 0 has ('weight', (6, 4), "
            "'torch.float32', True). Every rank must shard the same model (same parameter "
            "names and shapes) with the same settings")
        assert found["order"].startswith("RuntimeError: the ranks' forwards differ: rank ")
        assert "gathers unit 'a' while the ranks gather {0: 'a', 1: 'b'" in found["order"] or \
            "gathers unit 'b' while the ranks gather {0: 'a', 1: 'b'" in found["order"]


def test_mixed_precision_computes_in_the_dtype_asked_for(ranks):
    """bf16 and fp16 (FSDP2's param_dtype) at every stage, against one process with the same
    recipe in the same dtype. The ranks reduce 16-bit gradients in another order than one
    process sums its batch, so they drift apart at that dtype's rounding level, compounding
    over the steps: bounded, as for the other mixed-precision tests, by the distance the
    recipe itself puts between it and fp32 training. fp16 keeps 11 significant bits to bf16's
    8, so it lands closer to fp32: a user asking for fp16 gets fp16's smaller error."""
    _, reps = ranks
    for rep in reps:
        runs = {(r["stage"], r["precision"]): r for r in rep["precisions"]}
        assert len(runs) == 8
        for (stage, precision), r in runs.items():
            assert r["dtype"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
            assert 0 < r["precision_gap"] < 0.1, (stage, precision)
            assert r["max_abs_diff"] <= 2 * r["precision_gap"], (stage, precision, r)
        for stage in range(4):
            assert runs[stage, "fp16"]["precision_gap"] < runs[stage, "bf16"]["precision_gap"]


def test_replicated_root_parameters_are_whole_and_identical_on_every_rank(ranks):
    """root_params="replicate": the tied embedding no unit claims keeps its full shape on
    every rank, with the same averaged gradient as one process; the global clip norm counts
    it once."""
    found = cases(ranks, "root_replicate")
    assert len(found) == len(ranks[1])
    for rank, c in found:
        seen, ref = c["seen"], c["ref_seen"]
        assert seen["shape"] == seen["grad_shape"] == ref["shape"] == [19, 8], rank
        assert seen["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
        assert seen["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert max(ref["norms"]) > 0.05  # clipping was active
