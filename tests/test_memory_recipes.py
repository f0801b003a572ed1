"""Mixed precision has more than one accounting (issue 35, expert finding 3).

The ZeRO paper counts 2 (16-bit params) + 2 (16-bit grads) + 12 (fp32 master, m, v) = 16 bytes
per parameter with Adam. Megatron-LM accumulates and all-reduces gradients in an fp32 "main
grad" buffer: 2 + 4 + 12 = 18 bytes, and its distributed optimizer (ZeRO stage 1) keeps
6 + 12/d (Megatron Core's distributed-optimizer docs, "bf16 parameters, fp32 gradients").
`memory.*(..., grad_bytes=4)` is that recipe; these tests hold each ZeRO stage's division of it
to the formula, and show that the old 2-byte gradient (and two other plausible slips) fail.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from finding_text import without_links

from zero_lab import memory

PSI = 7_500_000_000  # divisible by every N below: the formula is exact, no padding
WORLD_SIZES = (1, 2, 8)
NOTEBOOK_01 = Path(__file__).resolve().parent.parent / "notebooks" / "01_memory_accounting.ipynb"


def per_param_per_rank(p: int, g: int, k: int, stage: int, n: int) -> dict[str, Fraction]:
    """The ZeRO paper's division, for any p, g, K: stage 1 shards K, 2 adds g, 3 adds p."""
    shard = Fraction(1, n)
    params = p * (shard if stage >= 3 else 1)
    grads = g * (shard if stage >= 2 else 1)
    optimizer = k * (shard if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer,
            "total": params + grads + optimizer}


MEGATRON = {"p": 2, "g": 4, "k": 12}  # bf16 params, fp32 main grads, fp32 master + m + v
PAPER = {"p": 2, "g": 2, "k": 12}  # the ZeRO paper's mixed precision with Adam


def mismatches(state_bytes, recipe: dict, **kwargs) -> list[str]:
    """Where `state_bytes(Ψ, stage, N, **kwargs)` differs from the formula, stages 0-3."""
    found = []
    for n in WORLD_SIZES:
        for stage in memory.STAGES:
            got = state_bytes(PSI, stage, n, **kwargs)
            want = {key: v * PSI for key, v in per_param_per_rank(**recipe, stage=stage,
                                                                  n=n).items()}
            if got != want:
                found.append(f"stage {stage}, N={n}: {got} != {want}")
    return found


# ------------------------------------------------------------ the fp32-gradient recipe


def test_fp32_gradients_in_mixed_precision_cost_18_bytes_per_parameter():
    b = memory.bytes_per_param("mixed", "adam", grad_bytes=4)
    assert b == {"params": 2, "grads": 4, "master": 4, "optimizer_states": 8, "optimizer": 12,
                 "total": 18}


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("stage", memory.STAGES)
def test_each_stage_divides_what_it_shards_of_the_18_bytes(stage, n):
    got = memory.model_state_bytes(PSI, stage, n, "mixed", "adam", grad_bytes=4)
    expected = {  # bytes per parameter per rank, written out
        0: 2 + 4 + 12,
        1: 2 + 4 + Fraction(12, n),  # the fp32 master is optimizer state: sharded at stage 1
        2: 2 + Fraction(4 + 12, n),  # the fp32 gradient is sharded from stage 2 on
        3: Fraction(2 + 4 + 12, n),
    }[stage]
    assert got["total"] == expected * PSI
    assert mismatches(memory.model_state_bytes, MEGATRON, grad_bytes=4) == []


@pytest.mark.parametrize("d", (1, 2, 8, 64))
def test_megatron_published_bytes_per_parameter(d):
    """Megatron Core's table, bf16 params and fp32 grads: 18 without its distributed optimizer,
    6 + 12/d with it (it shards the optimizer state, not the gradients: ZeRO stage 1)."""
    psi = 64 * 10**9  # divisible by every d
    states = memory.state_breakdown_by_stage(psi, d, grad_bytes=4)
    assert states[0]["total"] == 18 * psi
    assert states[1]["total"] == 6 * psi + 12 * psi // d


@pytest.mark.parametrize("optimizer", memory.OPTIMIZERS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_fp32_gradients_add_two_bytes_where_gradients_are_held(optimizer, n):
    """4-byte instead of 2-byte gradients: +2Ψ while gradients are replicated (stages 0, 1),
    +2Ψ/N once they are sharded (stages 2, 3); params and optimizer unchanged."""
    for stage in memory.STAGES:
        old = memory.model_state_bytes(PSI, stage, n, "bf16", optimizer)
        new = memory.model_state_bytes(PSI, stage, n, "bf16", optimizer, grad_bytes=4)
        assert new["grads"] - old["grads"] == (2 * PSI if stage < 2 else 2 * PSI // n)
        assert (new["params"], new["optimizer"]) == (old["params"], old["optimizer"])


# ------------------------------------------------------------------ mutants must fail


def old_two_byte_gradient(n_params, stage, world_size, **kwargs):
    """The accounting before issue 35: mixed precision's gradient is always 2 bytes."""
    kwargs.pop("grad_bytes")
    return memory.model_state_bytes(n_params, stage, world_size, **kwargs)


def fp32_gradient_replicated_at_stage_2(n_params, stage, world_size, **kwargs):
    out = dict(memory.model_state_bytes(n_params, stage, world_size, **kwargs))
    if stage == 2:
        out["grads"] = memory.model_state_bytes(n_params, 1, world_size, **kwargs)["grads"]
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def master_replicated_at_stage_1(n_params, stage, world_size, **kwargs):
    """Stage 1 shards m and v but keeps the fp32 master whole (it is optimizer state)."""
    out = dict(memory.model_state_bytes(n_params, stage, world_size, **kwargs))
    if stage == 1:
        out["optimizer"] = 4 * n_params + 8 * memory.partition_elements(n_params, world_size)
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


@pytest.mark.parametrize("mutant", [old_two_byte_gradient, fp32_gradient_replicated_at_stage_2,
                                    master_replicated_at_stage_1])
def test_the_formula_check_rejects_mutants(mutant):
    assert mismatches(mutant, MEGATRON, grad_bytes=4) != []


def test_the_old_two_byte_gradient_is_two_bytes_short():
    assert memory.bytes_per_param("mixed", "adam")["total"] == 16
    assert memory.bytes_per_param("mixed", "adam", grad_bytes=4)["total"] == 18


# ------------------------------------------------------- the paper's 16 bytes, unchanged


def test_the_papers_16_byte_recipe_is_unchanged():
    b = memory.bytes_per_param("mixed", "adam")
    assert b == {"params": 2, "grads": 2, "master": 4, "optimizer_states": 8, "optimizer": 12,
                 "total": 16}
    assert mismatches(memory.model_state_bytes, PAPER) == []
    assert mismatches(memory.model_state_bytes, PAPER, grad_bytes=2) == []
    assert memory.paper_figure1()[0] == 16 * 7_500_000_000


@pytest.mark.parametrize("precision", memory.PRECISIONS)
@pytest.mark.parametrize("optimizer", memory.OPTIMIZERS)
def test_grad_bytes_none_is_the_precisions_own(precision, optimizer):
    own = 4 if precision == "fp32" else 2
    b = memory.bytes_per_param(precision, optimizer)
    assert b["grads"] == own
    assert memory.bytes_per_param(precision, optimizer, grad_bytes=own) == b
    for stage in memory.STAGES:
        assert memory.model_state_bytes(10**6, stage, 8, precision, optimizer, grad_bytes=own) \
            == memory.model_state_bytes(10**6, stage, 8, precision, optimizer)


def test_fp32_training_with_16_bit_gradients_is_refused():
    with pytest.raises(ValueError, match=r"^grad_bytes must be None or 4 with precision 'fp32'"):
        memory.bytes_per_param("fp32", "adam", grad_bytes=2)


# ----------------------------------------------------- the other calculators follow


@pytest.mark.parametrize("stage", memory.STAGES)
@pytest.mark.parametrize("n", (1, 8, 64))
def test_largest_model_with_fp32_gradients_fits_and_the_next_does_not(stage, n):
    gpu = 80 * memory.GiB
    best = memory.largest_model(gpu, n, stage, grad_bytes=4)
    assert memory.model_state_bytes(best, stage, n, grad_bytes=4)["total"] <= gpu
    assert memory.model_state_bytes(best + 1, stage, n, grad_bytes=4)["total"] > gpu
    assert best <= memory.largest_model(gpu, n, stage)  # 18 bytes fit fewer than 16


@pytest.mark.parametrize("stage", (2, 3))
def test_offload_moves_the_fp32_gradient_partition(stage):
    n = 8
    r = memory.offload_state_bytes(PSI, stage, n, grad_bytes=4)
    assert r["cpu"]["grads"] == 4 * PSI // n
    assert r["gpu"]["total"] + r["cpu"]["total"] == memory.model_state_bytes(
        PSI, stage, n, grad_bytes=4)["total"]


@pytest.mark.parametrize("n", (2, 8))
def test_deepspeed_estimators_in_terms_of_the_fp32_gradient_recipe(n):
    """DeepSpeed's ZeRO-3 estimator (no offload) is this recipe at stage 3 plus one gathered
    layer; its ZeRO-2 estimator is this recipe at stage 2 plus a 2-byte gradient partition."""
    psi, layer = 600_060_000, 100_010_000  # the seed blog's model; divisible by n
    _, ds3, _ = memory.deepspeed_zero3_estimate(psi, layer, n, 1, False, False)
    assert ds3 == memory.model_state_bytes(psi, 3, n, grad_bytes=4)["total"] + 4 * layer
    _, ds2 = memory.deepspeed_zero2_estimate(psi, n, 1, cpu_offload=False)
    assert ds2 == memory.model_state_bytes(psi, 2, n, grad_bytes=4)["total"] + 2 * psi // n


# ------------------------------------------------------------- what notebook 01 says


def test_notebook_01_names_both_accountings_and_the_recipe():
    cells = json.loads(NOTEBOOK_01.read_text(encoding="utf-8"))["cells"]
    prose = " ".join(" ".join(without_links("".join(c["source"])).split())
                     for c in cells if c["cell_type"] == "markdown")
    code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "Megatron" in prose and "18" in prose and "main grad" in prose  # fp32 gradients
    assert "Real implementations hold the fp32 gradient only while the update runs" not in prose
    assert "grad_bytes=4" in code
