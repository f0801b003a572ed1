"""The decision figure (issue 48, part 3): every cell it draws is projection.recommend()'s
answer for that model, GPU count and accumulation count k, as notebook 07's scenario asks it.

The expected answers are asked of recommend() here, written out, not through the module; a
figure that ignored accumulation (its k = 8 panel a copy of k = 1) fails.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from zero_lab import memory  # noqa: E402
from zero_lab.course import decision_plot  # noqa: E402
from zero_lab.predict import projection  # noqa: E402

SIZES, GPUS, KS = (1.3e9, 7e9, 13e9, 70e9), (8, 64), (1, 8)


def asked(n_params: float, gpus: int, k: int) -> projection.Recommendation:
    shape = memory.gpt_shape(n_params)
    compute = projection.transformer_compute_time(n_params, 4 * 4096, shape["n_layers"],
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


def test_the_two_panels_differ_where_accumulation_changes_the_choice():
    grid = decision_plot.decision_grid(SIZES, GPUS, KS)
    changed = {(n, g) for n in SIZES for g in GPUS if grid[1, n, g] != grid[8, n, g]}
    assert (7e9, 8) in changed and grid[1, 7e9, 8].stage == 2 and grid[8, 7e9, 8].stage == 1


def test_mutant_a_figure_that_ignores_accumulation_fails(monkeypatch):
    real = decision_plot.gpt_recommendation
    monkeypatch.setattr(decision_plot, "gpt_recommendation",
                        lambda n, g, accumulation=1, attention="fused": real(n, g, 1, attention))
    with pytest.raises(AssertionError):
        check_figure_is_recommend()


def test_the_notebooks_check_of_the_figure_catches_a_mutant():
    """check_decision_figure: the figure's k = 1 cells are the table's; at k = 8 stage 2 only
    where stage 1 does not fit. Mutants: a figure cell differing from the table; a figure
    whose k = 8 panel ignored accumulation (stage 2 for 7B, where stage 1 fits)."""
    from zero_lab.grading.nb07_scaling import check_decision_figure

    grid = decision_plot.decision_grid((7e9, 13e9), (8,), KS)
    table = {(n, 8): asked(n, 8, 1) for n in (7e9, 13e9)}
    check_decision_figure(grid, table)
    with pytest.raises(AssertionError, match="not the table's|on 8"):
        check_decision_figure(grid, {**table, (7e9, 8): asked(13e9, 8, 1)})
    with pytest.raises(AssertionError, match="k = 8: stage 2"):
        check_decision_figure({**grid, (8, 7e9, 8): asked(7e9, 8, 1)}, table)
