"""The decision figure (issue 48, part 3): every cell it draws is projection.recommend()'s
answer for that model, GPU count and accumulation count k, as notebook 07's scenario asks it.

The expected answers are asked of recommend() here, written out, not through the module; a
figure that ignored accumulation (its k = 8 panel a copy of k = 1) fails. The rows the course
talks about are Llama 3.1 8B and Llama 3 70B, priced on their published shapes (issue 50);
a size between them (13B) keeps `memory.gpt_shape`'s guess.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from zero_lab import memory  # noqa: E402
from zero_lab.course import decision_plot, models  # noqa: E402
from zero_lab.predict import projection  # noqa: E402

SIZES, GPUS, KS = (models.PSI_8B, 13e9, models.PSI_70B), (8, 64), (1, 8)
PUBLISHED = {models.PSI_8B: models.LLAMA3_8B, models.PSI_70B: models.LLAMA3_70B}


def asked(n_params: float, gpus: int, k: int) -> projection.Recommendation:
    shape = PUBLISHED.get(n_params) or memory.gpt_shape(n_params)
    # Llama's input embedding is untied, a lookup: its V·h parameters do no matmul
    matmul = n_params - shape["vocab"] * shape["hidden"] if n_params in PUBLISHED else n_params
    compute = projection.transformer_compute_time(matmul, 4 * 4096, shape["n_layers"],
                                                  shape["hidden"], 4096, recompute="full")
    acts = memory.activation_bytes(shape["n_layers"], 4096, 4, shape["hidden"], shape["heads"],
                                   checkpointing="full", attention="fused")
    return projection.recommend(n_params, 80 * memory.GiB, gpus, "dgx_h100", compute,
                                activation_bytes=acts, buckets=shape["n_layers"],
                                activations_checkpointed=True, accumulation=k)


def drawn_cells(fig) -> dict:
    """{(k, n_params, gpus): the label drawn in that cell}, read back from the axes."""
    cells = {}
    for ax, k in zip(fig.axes, KS, strict=True):
        labels = iter(t.get_text() for t in ax.texts)
        for n in SIZES:
            for g in GPUS:
                cells[k, n, g] = next(labels)
    return cells


def check_figure_is_recommend() -> None:
    fig, grid = decision_plot.decision_figure(SIZES, GPUS, KS)
    try:
        drawn = drawn_cells(fig)
        for (k, n, g), label in drawn.items():
            rec = asked(n, g, k)
            assert grid[k, n, g] == rec, (k, n, g)
            assert label == decision_plot.CHOICES[decision_plot.choice(rec)][0], (k, n, g)
    finally:
        plt.close(fig)


def test_every_cell_drawn_is_recommends_answer():
    check_figure_is_recommend()


def test_the_rows_name_the_course_models():
    fig, _ = decision_plot.decision_figure(SIZES, GPUS, KS)
    try:
        rows = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    finally:
        plt.close(fig)
    assert rows == ["Llama 3.1 8B", "13B", "Llama 3 70B"]
    assert {models.PSI_8B, models.PSI_70B} <= set(decision_plot.SIZES)


def test_mutant_the_at_scale_rows_on_a_guessed_shape_fail(monkeypatch):
    """Llama 3 70B priced on gpt_shape(Ψ) (71 layers of 9,088) instead of its 80 of 8,192."""
    monkeypatch.setattr(decision_plot, "shape", lambda n: memory.gpt_shape(n))
    with pytest.raises(AssertionError):
        check_figure_is_recommend()


def test_the_two_panels_differ_where_accumulation_changes_the_choice():
    grid = decision_plot.decision_grid(SIZES, GPUS, KS)
    changed = {(n, g) for n in SIZES for g in GPUS if grid[1, n, g] != grid[8, n, g]}
    psi = models.PSI_8B
    assert (psi, 8) in changed and grid[1, psi, 8].stage == 2 and grid[8, psi, 8].stage == 1


def test_mutant_a_figure_that_ignores_accumulation_fails(monkeypatch):
    real = decision_plot.gpt_recommendation
    monkeypatch.setattr(decision_plot, "gpt_recommendation",
                        lambda n, g, accumulation=1, attention="fused": real(n, g, 1, attention))
    with pytest.raises(AssertionError):
        check_figure_is_recommend()


def test_the_notebooks_check_of_the_figure_catches_a_mutant():
    """check_decision_figure: the figure's k = 1 cells are the table's; at k = 8 stage 2 only
    where stage 1 does not fit. Mutants: a figure cell differing from the table; a figure
    whose k = 8 panel ignored accumulation (stage 2 for Llama 3.1 8B, where stage 1 fits)."""
    from zero_lab.grading.nb07_scaling import check_decision_figure

    psi = models.PSI_8B
    grid = decision_plot.decision_grid((psi, 13e9), (8,), KS)
    table = {(n, 8): asked(n, 8, 1) for n in (psi, 13e9)}
    check_decision_figure(grid, table)
    with pytest.raises(AssertionError, match="not the table's|on 8"):
        check_decision_figure(grid, {**table, (psi, 8): asked(13e9, 8, 1)})
    with pytest.raises(AssertionError, match="k = 8: stage 2"):
        check_decision_figure({**grid, (8, psi, 8): asked(psi, 8, 1)}, table)
