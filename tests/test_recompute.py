"""Recompute per unit (`shard(..., checkpoint_activations=...)`, zero_lab/stages/recompute.py)
at every stage, and the trade-off calculator (zero_lab/predict/recompute.py).

The multi-rank numbers come from tests/workers/recompute_cases.py, one part of the launch of
tests/workers/world_cases.py at N = 2 and 4: a 3-block GPT, 3 steps of Adam at stages 0-3,
with and without recompute, against one process on the global batch. Every check of
zero_lab/grading/nb08_knobs_recompute.py used here is also fed a mutant that must fail it.
"""

from __future__ import annotations

import pytest
import torch
from common import case_reports
from torch import nn

from zero_lab import memory
from zero_lab.course import workloads as W
from zero_lab.grading import nb08_knobs_recompute as checks
from zero_lab.measure.memory import saved_activation_bytes
from zero_lab.predict import projection
from zero_lab.predict.recompute import (
    STAGES,
    choose,
    choose_measured,
    decisive_budgets,
    per_rank_peak,
)
from zero_lab.stages.recompute import modules_to_recompute, recompute
from zero_lab.stages.refusals import check_checkpoint_activations

GB = 10**9
FP32_ATOL = 1e-6


@pytest.fixture(scope="module", params=(2, 4), ids=lambda n: f"N={n}")
def runs(request) -> tuple[int, tuple[dict, ...]]:
    return request.param, tuple(r["recompute"] for r in case_reports("recompute", request.param))


def _by_key(cases: list[dict]) -> dict[tuple[int, bool], dict]:
    return {(c["stage"], c["recompute"]): c for c in cases}


# ------------------------------------------------------------------ on N ranks


def test_recompute_trains_equal_to_one_process_and_to_itself_without(runs):
    n, reports = runs
    for rep in reports:
        cases = _by_key(rep)
        assert len(cases) == 8
        for c in cases.values():
            assert c["max_abs_diff"] <= FP32_ATOL, c
        checks.check_recompute_is_exact({k: c["digest"] for k, c in cases.items()})
    # every rank holds the same weights (stages may differ from each other in the last bit:
    # an all-reduce and a reduce-scatter sum the ranks' gradients in different orders)
    for key in _by_key(reports[0]):
        assert len({_by_key(rep)[key]["digest"] for rep in reports}) == 1, key


def test_recompute_sends_no_extra_collective(runs):
    """Stage 3 included: the unit is gathered for its backward anyway, and the recompute runs
    inside that backward. 2 all-gathers + 1 reduce-scatter per unit, with or without."""
    n, reports = runs
    for rep in reports:
        cases = _by_key(rep)
        for stage in range(4):
            on, off = cases[stage, True], cases[stage, False]
            units = len(on["groups"]) if stage == 3 else None
            checks.check_recompute_sends_nothing_more(stage, off["ledger"], on["ledger"], units)
            checks.check_step_collectives(stage, on["groups"], on["ledger"])


def test_recompute_lowers_the_peak_and_leaves_the_states(runs):
    n, reports = runs
    cases = _by_key(reports[0])
    ratios = checks.check_recompute_lowers_the_peak(
        {k: c["peak_bytes"] for k, c in cases.items()})
    assert all(0 < r < 1 for r in ratios.values())
    for stage in range(4):
        assert cases[stage, True]["held_after_step"] == cases[stage, False]["held_after_step"]


def test_the_checks_fail_their_mutants(runs):
    n, reports = runs
    cases = _by_key(reports[0])
    on, off = cases[3, True], cases[3, False]
    units = len(on["groups"])
    # a recompute that gathers every unit once more (a naive composition: FSDP1 with the
    # checkpoint outside its hooks)
    regathered = on["ledger"] + [r for r in on["ledger"] if r[0] == "all_gather"][:units]
    with pytest.raises(AssertionError, match="with recompute"):
        checks.check_recompute_sends_nothing_more(3, off["ledger"], regathered, units)
    # a stage 3 that gathers each unit once (reshard_after_forward=False) is not stage 3's count
    once = [r for r in off["ledger"] if r[0] != "all_gather"] + sorted(
        {tuple(r) for r in off["ledger"] if r[0] == "all_gather"})
    with pytest.raises(AssertionError, match="all-gathers"):
        checks.check_recompute_sends_nothing_more(3, once, once, units)
    with pytest.raises(AssertionError, match="the formula says"):
        checks.check_step_collectives(3, on["groups"], regathered)
    digests = {k: c["digest"] for k, c in cases.items()}
    with pytest.raises(AssertionError, match="changed the weights"):
        checks.check_recompute_is_exact({**digests, (2, True): "0" * 64})
    peaks = {k: c["peak_bytes"] for k, c in cases.items()}
    with pytest.raises(AssertionError, match="stage 1"):  # recompute that saved nothing
        checks.check_recompute_lowers_the_peak({**peaks, (1, True): peaks[1, False]})


# ------------------------------------------------------------------ one process


def test_which_modules_are_recomputed():
    gpt = W.TinyGPT(n_layers=2)
    names = [n for n, _ in modules_to_recompute(gpt, True)]
    assert names == ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "ln_f", "head"]
    assert [n for n, _ in modules_to_recompute(gpt, True, (W.Block,))] == ["blocks.0",
                                                                            "blocks.1"]
    # the outermost only: a LayerNorm inside a recomputed Block is recomputed with it
    names = [n for n, _ in modules_to_recompute(gpt, (W.Block, nn.LayerNorm))]
    assert names == ["blocks.0", "blocks.1", "ln_f"]
    assert modules_to_recompute(gpt, False) == []
    with pytest.raises(ValueError, match="chose no module"):
        modules_to_recompute(gpt, (nn.Conv1d,))
    with pytest.raises(ValueError, match="chose no module"):  # the root is never recomputed
        modules_to_recompute(gpt, (W.TinyGPT,))
    for bad in ("yes", (), (int,), [nn.Linear, 3], nn.Linear):
        with pytest.raises(TypeError, match="checkpoint_activations"):
            check_checkpoint_activations(bad)


def test_a_recomputed_block_gives_the_same_gradients_and_keeps_only_its_input():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    twin = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    twin.load_state_dict(block.state_dict())
    recompute(twin)
    recompute(twin)  # twice is once
    x = torch.randn(16, 32, requires_grad=True)
    saved = [saved_activation_bytes(lambda m=m: m(x).sum().backward(), exclude=m.parameters())
             for m in (block, twin)]
    for a, b in zip(block.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    # the plain block keeps its input and the 128-wide hidden twice (GELU's input, the second
    # Linear's input); the recomputed one its input only
    assert saved == [16 * 32 * 4 + 2 * 16 * 128 * 4, 16 * 32 * 4]


# ------------------------------------------------------------------ the trade-off


LLAMA_13B = dict(n_layers=40, hidden=5120, heads=40)


def test_stage_3_runs_13b_without_recompute_where_stage_1_needs_it():
    """13B on 16 x 80 GB (two 8-GPU nodes), 4096 tokens, micro-batch 1, fused attention,
    bf16 + Adam, 72 GB usable (notebook 07's 10% reserve kept free): stage 1 holds (2+2)Ψ +
    12Ψ/16 = 61.75 GB of states, and the 28.5 GB of activations only fit with recompute
    (2·s·b·h per layer); stage 3 holds 13 GB of states and fits them as they are, with 6Ψ
    FLOPs per token instead of 8Ψ."""
    decision = choose(80 * GB, 13e9, 16, seq_len=4096, batch=1, **LLAMA_13B)
    assert decision == {0: None, 1: "on", 2: "off", 3: "off"}
    checks.check_tradeoff(decision)
    peak = per_rank_peak(13e9, 1, 16, seq_len=4096, batch=1, recompute=False, **LLAMA_13B)
    states = memory.model_state_bytes(13e9, 1, 16)["total"]
    acts = memory.activation_bytes(40, 4096, 1, 5120, 40, attention="fused")
    assert states < 72 * GB < states + acts < peak
    flops = {r: projection.flops_per_token(13e9, 40, 5120, 4096, r) for r in ("none", "full")}
    assert flops["full"] / flops["none"] == pytest.approx(4 / 3)  # a third more, attention too
    # mutants: at micro-batch 2 stage 3 needs recompute too; a 160 GB GPU fits stage 1 as is
    with pytest.raises(AssertionError):
        checks.check_tradeoff(choose(80 * GB, 13e9, 16, seq_len=4096, batch=2, **LLAMA_13B))
    with pytest.raises(AssertionError):
        checks.check_tradeoff(choose(160 * GB, 13e9, 16, seq_len=4096, batch=1, **LLAMA_13B))


def test_choose_keeps_the_reserve_notebook_07_keeps():
    """13B on 8 x 80 GB: stage 2 without recompute peaks at 79.2 GB, which leaves 0.8 GB of
    the 8 GB that `projection.recommend` keeps free (10% of the GPU, above the peak floor that
    `per_rank_peak` counts): it needs recompute, and stage 1 fits neither way."""
    peak = per_rank_peak(13e9, 2, 8, seq_len=4096, batch=1, recompute=False, **LLAMA_13B)
    assert 72 * GB < peak < 80 * GB
    decision = choose(80 * GB, 13e9, 8, seq_len=4096, batch=1, **LLAMA_13B)
    assert decision == {0: None, 1: None, 2: "on", 3: "off"}
    # the same rule as notebook 07's decision table, stage by stage
    for n_ranks in (8, 16):
        fits = {}
        for r in (False, True):
            acts = memory.activation_bytes(40, 4096, 1, 5120, 40, attention="fused",
                                           checkpointing="full" if r else "none")
            rows = projection.candidates(13e9, 80 * GB, n_ranks, "dgx_h100", 1.0,
                                         activation_bytes=acts, buckets=40, hybrid=False)
            fits[r] = {row["stage"]: row["fits_memory"] for row in rows}
        expected = {s: "off" if fits[False][s] else "on" if fits[True][s] else None
                    for s in STAGES}
        assert choose(80 * GB, 13e9, n_ranks, seq_len=4096, batch=1, **LLAMA_13B) == expected
    # no reserve: the old answer, stage 2 at 79.2 of 80 GB
    assert choose(80 * GB, 13e9, 8, seq_len=4096, batch=1, reserve_fraction=0,
                    **LLAMA_13B)[2] == "off"


def test_decisive_budgets_from_measured_peaks():
    peaks = {(1, False): 300, (1, True): 200, (3, False): 240, (3, True): 170}
    assert decisive_budgets(peaks) == (240, 300)
    assert choose_measured(peaks, 250) == {1: "on", 3: "off"}
    checks.check_tradeoff(choose_measured(peaks, 250))
    # stage 3 frees less than recompute saves: no budget decides for it
    assert decisive_budgets({**peaks, (3, False): 310}) is None
    assert choose_measured(peaks, 150) == {1: None, 3: None}
