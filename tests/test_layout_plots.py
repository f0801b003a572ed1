"""Notebook 08's HSDP grid and notebook 09's FSDP2-beside-flat figure
(zero_lab/course/layout_plots.py), drawn from reports shaped as the launches write them.

Mutants: the grid placing rank k at column k // S (rank 1's label lands in row 1); the FSDP2
figure drawing the rule instead of what each rank reported (a rank holding 11 of 32 rows on
the last of 3 ranks is drawn rather than refused)."""

from __future__ import annotations

import copy

import matplotlib
import pytest
from test_hsdp import knob_report

from zero_lab.course import layout_plots

matplotlib.use("Agg")


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_the_hsdp_grid_puts_rank_k_in_row_k_over_s_and_shows_each_ranks_own_numbers():
    reports = [copy.deepcopy(knob_report()) for _ in range(4)]
    for k, rep in enumerate(reports):
        rep["hsdp"]["held_bytes"] = (k + 1) * 1024
    fig = layout_plots.hsdp_grid_figure(reports)
    boxes = {t.get_text().split("\n")[0]: t.get_position() for ax in fig.axes for t in ax.texts
             if t.get_text().startswith("rank ")}
    assert boxes["rank 1"][1] == boxes["rank 0"][1] < boxes["rank 2"][1]  # one row, then the next
    assert boxes["rank 2"][0] == boxes["rank 0"][0]  # one column: slice 1
    texts = "\n".join(_texts(fig))
    assert "rank 3\nslice 2 of 2\nholds 4.0 KiB" in texts
    assert "shard group 1:" in texts and "replicate group 1: all-reduce" in texts
    with pytest.raises(ValueError, match="3 reports for a 2 x 2 mesh"):
        layout_plots.hsdp_grid_figure(reports[:3])


def _fsdp2_reports(n: int, held=None) -> list[dict]:
    """Three parameters of group "blocks.0" on `n` ranks, each rank's local rows its own."""
    shapes = {"blocks.0.a.weight": [32, 4], "blocks.0.b.weight": [2], "blocks.0.c.weight": [6, 2]}
    rows = held or {"blocks.0.a.weight": [11, 11, 10], "blocks.0.b.weight": [1, 1, 0],
                    "blocks.0.c.weight": [2, 2, 2]}
    return [{"wrap": {"groups": [{"module": "blocks.0", "params": list(shapes)}],
                      "params": [{"name": name, "global": shape,
                                  "local": [rows[name][r], *shape[1:]]}
                                 for name, shape in shapes.items()]}} for r in range(n)]


def test_fsdp2_pads_each_parameter_where_the_flat_buffer_pads_once():
    fig = layout_plots.fsdp2_vs_flat_figure(_fsdp2_reports(3), "blocks.0")
    top, bottom = fig.axes
    hatched = [p for p in top.patches if p.get_hatch()]
    assert len(hatched) == 2  # a's last rank and b's last rank: a row short each
    assert [p.get_width() for p in hatched] == [4, 1]
    assert len([p for p in bottom.patches if p.get_hatch()]) == 1  # 142 elements: 48 x 3 - 2
    assert "FSDP2: each parameter cut on dim 0, 147 elements" in top.get_title(loc="left")
    assert "flat buffer: the group cut once, 144 elements" in bottom.get_title(loc="left")


def test_the_fsdp2_figure_refuses_a_cut_the_ranks_did_not_report():
    wrong = {"blocks.0.a.weight": [11, 10, 11], "blocks.0.b.weight": [1, 1, 0],
             "blocks.0.c.weight": [2, 2, 2]}
    with pytest.raises(ValueError, match=r"blocks.0.a.weight: ranks hold \[11, 10, 11\] rows"):
        layout_plots.fsdp2_vs_flat_figure(_fsdp2_reports(3, wrong), "blocks.0")
    with pytest.raises(ValueError, match="group 'blocks.9' is not in the report"):
        layout_plots.fsdp2_vs_flat_figure(_fsdp2_reports(3), "blocks.9")
