"""The precision policy of shard() (zero_lab/stages/mixed_precision.py): modules kept in fp32
(`keep_fp32=(nn.LayerNorm,)`) and gradients reduced in fp32 (`reduce_dtype=torch.float32`).

The multi-rank numbers come from tests/workers/recompute_cases.py (one part of the launch of
tests/workers/world_cases.py, N = 2 and 4): a 3-block GPT in bf16, 3 steps of Adam, stages
0-3, each recipe against one process with the same recipe (mixed_precision_reference) and
that one process against fp32 training, as tests/test_stages.py measures plain bf16.
"""

from __future__ import annotations

import pytest
import torch
from common import case_reports
from torch import nn

from zero_lab import memory
from zero_lab.course import workloads as W
from zero_lab.grading import nb08_knobs_recompute as checks
from zero_lab.stages.mixed_precision import (
    check_policy,
    kept_parameter_ids,
    mixed_precision_reference,
)

KEPT = ("ln1", "ln2", "ln_f")  # TinyGPT's LayerNorms


@pytest.fixture(scope="module", params=(2, 4), ids=lambda n: f"N={n}")
def runs(request) -> tuple[int, tuple[dict, ...]]:
    return request.param, case_reports("recompute", request.param)


def test_each_recipe_stays_near_its_one_process_reference(runs):
    n, reports = runs
    gaps = reports[0]["fp32_gap"]
    cases = reports[0]["precision"]
    assert len(cases) == 9
    for c in cases:
        checks.check_recipe_distance(f"{c['recipe']} stage {c['stage']}", c["max_abs_diff"],
                                     gaps[c["recipe"]])
    # reducing in fp32 does not exist in one process: its reference is plain bf16's
    assert gaps["bf16+reduce_fp32"] == gaps["bf16"]
    assert gaps["bf16+keep_ln"] != gaps["bf16"]


def test_kept_modules_compute_in_fp32_and_hand_back_bf16(runs):
    n, reports = runs
    for c in reports[0]["precision"]:
        kept = KEPT if "keep_ln" in c["recipe"] else ()
        checks.check_kept_in_fp32(c["seen"], kept)
        assert len(c["seen"]) == 3 * 6 + 2  # every LayerNorm and Linear ran


def test_a_step_sends_what_the_formula_says(runs):
    """Per group: bf16 parameters all-gathered at 2 bytes an element; gradients reduced at 4
    with reduce_dtype=float32 (or when the group is kept in fp32), else 2."""
    n, reports = runs
    for rep in reports:
        for c in rep["precision"]:
            kept_groups = [g for g in c["groups"] if g["dtype"] == "torch.float32"]
            assert bool(kept_groups) == ("keep_ln" in c["recipe"]), c["recipe"]
            assert all(g["reduce_fp32"] == ("reduce_fp32" in c["recipe"])
                       for g in c["groups"] if g["dtype"] != "torch.float32")
            checks.check_step_collectives(c["stage"], c["groups"], c["ledger"])
    # stage 3 keeps every LayerNorm a unit of its own: 7 fp32 units of 16 elements
    three = [c for c in reports[0]["precision"] if c["stage"] == 3 and "keep_ln" in c["recipe"]]
    for c in three:
        assert sorted(g["numel"] for g in c["groups"] if g["dtype"] == "torch.float32") == [16] * 7


def test_the_checks_fail_their_mutants(runs):
    n, reports = runs
    gaps = reports[0]["fp32_gap"]
    c = next(c for c in reports[0]["precision"]
             if c["stage"] == 2 and c["recipe"] == "bf16+reduce_fp32")
    # the reduce-scatter sent in bf16 although reduce_dtype=float32 was asked
    narrowed = [[op, "bfloat16" if op == "reduce_scatter" else dt, k] for op, dt, k in c["ledger"]]
    with pytest.raises(AssertionError, match="the formula says"):
        checks.check_step_collectives(2, c["groups"], narrowed)
    assert checks.volume(narrowed) < checks.volume(c["ledger"])
    # a sharded run further from its reference than the recipe's own error allows
    with pytest.raises(AssertionError, match="more than twice"):
        checks.check_recipe_distance("mutant", 2.5 * gaps["bf16"], gaps["bf16"])
    with pytest.raises(AssertionError, match="from fp32 training"):  # fp32 called a recipe
        checks.check_recipe_distance("mutant", 0.0, 0.0)
    # a LayerNorm that kept its fp32 weights but got bf16 inputs (inputs not cast)
    kept = next(c for c in reports[0]["precision"] if "keep_ln" in c["recipe"])
    seen = {**kept["seen"], "blocks.0.ln1": ["torch.float32", "torch.bfloat16"]}
    with pytest.raises(AssertionError, match="blocks.0.ln1"):
        checks.check_kept_in_fp32(seen, KEPT)
    # a Linear that received the kept LayerNorm's fp32 output (outputs not cast back)
    seen = {**kept["seen"], "blocks.0.attn.qkv": ["torch.bfloat16", "torch.float32"]}
    with pytest.raises(AssertionError, match="qkv"):
        checks.check_kept_in_fp32(seen, KEPT)


# ------------------------------------------------------------------ one process


def test_the_reference_keeps_layernorms_fp32_and_trains():
    torch.manual_seed(0)
    model, opt = mixed_precision_reference(W.TinyGPT(n_layers=2, bias=False), keep_fp32=(
        nn.LayerNorm,))
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if ".ln" in name or name.startswith("ln")
                           else torch.bfloat16), name
    batch = W.gpt_batch(0, 4, 16, 64)
    loss = W.next_token_loss(model, batch)
    assert loss.dtype == torch.float32
    loss.backward()
    opt.step()
    # a kept parameter's master holds its value exactly (nothing was rounded)
    for p, m in zip(opt.params, opt.master_weights, strict=True):
        if p.dtype == torch.float32:
            assert torch.equal(p, m)


def test_policy_refusals():
    with pytest.raises(ValueError, match="refine mixed precision"):
        check_policy("fp32", (nn.LayerNorm,), None)
    with pytest.raises(ValueError, match="refine mixed precision"):
        check_policy("fp32", (), torch.float32)
    with pytest.raises(ValueError, match="reduce_dtype must be None"):
        check_policy("bf16", (), torch.float16)
    with pytest.raises(TypeError, match="keep_fp32"):
        check_policy("bf16", nn.LayerNorm, None)
    with pytest.raises(TypeError, match="reduce_dtype"):
        check_policy("bf16", (), "fp32")
    check_policy("bf16", (nn.LayerNorm,), torch.float32)
    check_policy("fp16", (), torch.float16)  # the compute dtype: the default
    gpt = W.TinyGPT(n_layers=1)  # head tied to the embedding: keeping one keeps both? refused
    with pytest.raises(ValueError, match="has one dtype"):
        kept_parameter_ids(gpt, (nn.Embedding,))
    assert len(kept_parameter_ids(gpt, (nn.Embedding, nn.Linear, nn.LayerNorm))) > 0


def test_a_kept_parameter_costs_16_bytes_at_stages_0_and_3_and_more_between():
    """Kept in fp32 it is its own master: 4 + 4 + 8 = 16 bytes, as bf16's 2 + 2 + 12; but
    stages 1-2 replicate the parameters (and stage 1 the gradients), at 4 bytes instead of
    2."""
    for stage in range(4):
        fp32 = memory.model_state_bytes(1000, stage, 4, "fp32")["total"]
        bf16 = memory.model_state_bytes(1000, stage, 4, "mixed")["total"]
        assert (fp32 == bf16) == (stage in (0, 3)), stage
