"""recommend() with gradient accumulation (issue 48): k micro-batches per optimizer step change
what each stage sends, as the stages really accumulate, and so the choice.

Notebook 08 measures the bytes (`knobs.accumulation_messages`, ledger == formula); the
projection prices the same passes, so the recommendation and that measurement agree: stage 2
(DeepSpeed's ZeRO-2) sends (k+1)Ψ, 4.5x stage 1's 2Ψ at k = 8. Before issue 48 recommend()
took no accumulation at all (TypeError), and chose stage 2 at every k for the model notebook 07
now prices as Llama 3.1 8B. The course's at-scale models (issue 50) on their published shapes;
13B, between them, on `memory.gpt_shape`'s guess.
"""

from __future__ import annotations

import re

import pytest

from zero_lab import memory
from zero_lab.course import models
from zero_lab.predict import micro_batches, projection
from zero_lab.predict.knobs import accumulation_messages, accumulation_volume

GiB = 2**30
KS = (1, 2, 8, 32)
PSI_8B, PSI_70B = models.PSI_8B, models.PSI_70B
PUBLISHED = {PSI_8B: models.LLAMA3_8B, PSI_70B: models.LLAMA3_70B}


def gpt(n_params: float, gpus: int, k: int = 1, **kw) -> projection.Recommendation:
    """Notebook 07's scenario, written out here on its own (not through the figure module):
    Llama's published shape, its untied embedding a lookup (no matmul), else a GPT shape."""
    shape = PUBLISHED.get(n_params) or memory.gpt_shape(n_params)
    matmul = n_params - shape["vocab"] * shape["hidden"] if n_params in PUBLISHED else n_params
    compute = projection.transformer_compute_time(matmul, 4 * 4096, shape["n_layers"],
                                                  shape["hidden"], 4096, recompute="full")
    acts = memory.activation_bytes(shape["n_layers"], 4096, 4, shape["hidden"], shape["heads"],
                                   checkpointing="full", attention="fused")
    return projection.recommend(n_params, 80 * GiB, gpus, "dgx_h100", compute,
                                activation_bytes=acts, buckets=shape["n_layers"],
                                activations_checkpointed=True, accumulation=k, **kw)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("stage,mode", [(0, "unsharded"), (1, "unsharded"), (2, "sharded"),
                                        (2, "unsharded"), (3, "sharded"), (3, "unsharded")])
def test_the_projection_prices_notebook_08s_passes(stage, mode, k):
    """Collectives per optimizer step = knobs.accumulation_messages' passes x buckets, and the
    volume = accumulation_volume: one formula, measured in notebook 08, priced here."""
    buckets = 12
    step = projection.project_step(PSI_8B, stage, 16, "dgx_h100", 1.0, buckets=buckets,
                                   accumulation=k, grad_accumulation=mode)
    passes = accumulation_messages(stage, 1, k, 2, grad_accumulation=mode)
    assert step["calls"] == {op: int(m["count"]) * buckets for op, m in passes.items()}
    assert step["volume_psi"] == pytest.approx(
        accumulation_volume(stage, k, grad_accumulation=mode))
    assert step["step_s"] >= k * 1.0  # k micro-batches of compute


def test_zero2_sends_four_and_a_half_times_stage_1_at_k_8():
    """Notebook 08 measured (k+1)/2 = 4.5 at k = 8; candidates() prices the same."""
    rows = {r["stage"]: r for r in projection.candidates(
        PSI_8B, 80 * GiB, 8, "dgx_h100", 1.0, accumulation=8)[::-1]}  # stage 3: "sharded"
    assert rows[2]["volume_psi"] / rows[1]["volume_psi"] == pytest.approx(4.5)
    assert rows[0]["volume_psi"] == rows[1]["volume_psi"] == 2


def test_k_1_is_the_recommendation_before():
    for n, g in ((PSI_8B, 8), (PSI_8B, 64), (13e9, 64), (PSI_70B, 8), (PSI_70B, 64)):
        assert gpt(n, g) == gpt(n, g, 1)
        assert len(projection.candidates(PSI_8B, 80 * GiB, g, "dgx_h100", 1.0)) == 4 + (g > 8)


def test_accumulation_turns_llama_8b_from_stage_2_to_stage_1_and_says_why():
    at_1, at_8 = gpt(PSI_8B, 8), gpt(PSI_8B, 8, 8)
    assert (at_1.stage, at_8.stage) == (2, 1)
    assert at_8.fits and at_8.accumulation == 8
    assert "stage 2 sends (k+1)Ψ = 9Ψ at k = 8" in at_8.reason
    assert "stage 1 sends 2Ψ at k = 8" in at_8.reason
    assert "k = " not in at_1.reason  # no accumulation words at k = 1


def test_stage_2_stays_where_stage_1_does_not_fit():
    rec = gpt(13e9, 8, 8)
    assert rec.stage == 2 and "stage 1 needs" in rec.reason
    assert "stage 2 sends (k+1)Ψ = 9Ψ at k = 8" in rec.reason


def test_stage_3_holding_unsharded_gradients_counts_their_memory():
    """FSDP2's set_requires_gradient_sync(False): (2k+1)Ψ, and the full gradients on every
    rank (stage 1's gradients) instead of their slice."""
    rows = projection.candidates(PSI_70B, 80 * GiB, 64, "dgx_h100", 1.0, accumulation=8)
    flat3 = [r for r in rows if r["stage"] == 3 and r["mesh"] is None]
    assert [r["grad_accumulation"] for r in flat3] == ["sharded", "unsharded"]
    sharded, unsharded = flat3
    full = memory.model_state_bytes(PSI_70B, 1, 64)["grads"]
    slice_ = memory.model_state_bytes(PSI_70B, 3, 64)["grads"]
    assert unsharded["model_state_bytes"] - sharded["model_state_bytes"] == full - slice_
    assert (sharded["volume_psi"], unsharded["volume_psi"]) == (24, 17)
    rec = gpt(PSI_70B, 64, 8)
    assert rec.stage == 3 and rec.grad_accumulation == "sharded"
    assert "stage 3 (gradients unsharded) would send (2k+1)Ψ = 17Ψ" in rec.reason


@pytest.mark.parametrize("stage,mode", list(micro_batches.HOW))
def test_the_formula_in_words_is_the_volume(stage, mode):
    formula = micro_batches.volume_formula(stage, mode)
    assert re.fullmatch(r"\d+Ψ|\d*kΨ|\(\d*k\+\d+\)Ψ", formula), formula
    for k in range(1, 17):  # '(2k+1)Ψ' at k = 8: (2*8+1)
        value = eval(re.sub(r"(\d*)k", lambda m, k=k: f"{m.group(1) or 1}*{k}",
                            formula.removesuffix("Ψ")))
        assert value == accumulation_volume(stage, k, grad_accumulation=mode), (formula, k)


def test_nothing_fits_says_tensor_parallelism_does_not_shrink_the_states():
    """Llama 3 70B on 8 x 80 GiB: 16Ψ/N = 131.4 GiB of states a GPU, 1,051 GiB on 640 GiB.
    Tensor parallelism divides activations and the gathered unit, not that."""
    rec = gpt(PSI_70B, 8)
    assert not rec.fits
    assert "tensor parallelism would not help" in rec.reason
    assert "1051.3 GiB of states on 8 x 80.0 GiB = 640.0 GiB" in rec.reason


def test_nothing_fits_because_of_activations_names_tensor_parallelism():
    """States that fit, activations that do not: TP inside the node (t = 8) divides them."""
    rec = projection.recommend(PSI_8B, 80 * GiB, 8, "dgx_h100", 1.0, activation_bytes=100 * GiB)
    assert not rec.fits
    assert "the activations are the reason: tensor parallelism inside a node (t = 8)" in rec.reason
    assert rec.reason.endswith("which fits")


def test_accumulation_is_checked():
    with pytest.raises(ValueError, match="accumulation"):
        projection.recommend(PSI_8B, 80 * GiB, 8, "dgx_h100", 1.0, accumulation=0)
