"""Figures of notebooks 01 and 05 say what their text says (cheap: no launch, no notebook run).

- Notebook 01's activations figure: one attention kind for every curve, so at every sequence
  length full recompute <= selective <= none (mixing kinds drew "full" above "selective").
- Notebook 05's lifecycle figure: every panel on one y-axis from 0 (stage 3's sawtooth is
  read against stage 0's level), units labelled u0, u1, ... as the text counts them (the
  MLP's module names gave u0, u2, ..., u10).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from zero_lab import memory  # noqa: E402
from zero_lab.course import plots  # noqa: E402

# Notebook 01, section 5: a 7B GPT (32 layers, h = 4096, 32 heads), micro-batch 1
SEQ_LENS = [1024, 2048, 4096, 8192, 16384, 32768]


def test_activation_curves_order_full_selective_none_at_every_length():
    """The figure's kind, fused, for every mode. (The old figure drew all three with the
    paper's unfused count and called "selective" the fused one: full recompute then adds one
    layer's s² attention and rose above selective, 172 vs 136 GiB at s = 32,768.)"""
    curves = plots.activation_curves(32, 4096, 32, SEQ_LENS, attention="fused")
    assert set(curves) == set(memory.CHECKPOINTING)
    for i, s in enumerate(SEQ_LENS):
        full, selective, none = (curves[m][i] for m in ("full", "selective", "none"))
        assert full <= selective <= none, (s, full, selective, none)


def test_activation_figure_plots_those_curves_and_names_its_attention_kind():
    states = memory.model_state_bytes(7e9, 3, 8)["total"]
    curves = plots.activation_curves(32, 4096, 32, SEQ_LENS, attention="fused")
    fig = plots.activations_vs_states_figure(SEQ_LENS, curves, states, attention="fused",
                                             title="7B GPT, micro-batch 1")
    try:
        ax = fig.axes[0]
        drawn = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
        by_mode = {m: next(v for k, v in drawn.items() if k.endswith(f", {m}"))
                   for m in memory.CHECKPOINTING}
        for i in range(len(SEQ_LENS)):
            assert by_mode["full"][i] <= by_mode["selective"][i] <= by_mode["none"][i]
        assert by_mode["full"][-1] == pytest.approx(curves["full"][-1] / memory.GiB)
        assert "fused attention" in ax.get_title()
    finally:
        plt.close(fig)


def _run(samples, gathers=(), units=()):
    marks = [(i, f"forward gather {name}") for i, name in gathers]
    marks += [(len(samples) // 3, "forward done"), (2 * len(samples) // 3, "backward done")]
    run = {"samples": samples, "marks": marks, "held": {"total": min(samples)}}
    if units:
        run["units"] = [{"unit": name} for name in units]
    return run


def test_lifecycle_panels_share_one_y_axis_from_zero_and_count_units_from_zero():
    names = ["0", "2", "4", "6", "8", "10"]  # an MLP's Linear layers: Sequential indices
    stage3 = _run([1000 + 300 * (i % 3) for i in range(30)],
                  gathers=[(2 + 2 * k, n) for k, n in enumerate(names)], units=names)
    stage0 = _run([9000 + 10 * (i % 2) for i in range(30)])
    fig = plots.lifecycle_timeline_figure({"stage 3": stage3, "stage 0": stage0})
    try:
        axes = [ax for ax in fig.axes if ax.get_title(loc="left")]
        assert len(axes) == 2
        limits = {ax.get_ylim() for ax in axes}
        assert len(limits) == 1, limits                     # one y-axis for every panel
        (bottom, top), = limits
        assert bottom == 0 and top >= 9010 / 2**10
        labels = [t.get_text() for t in axes[0].texts]
        assert labels == [f"u{k}" for k in range(len(names))]   # u0 ... u5, as the text says
        assert "u0-u5" in axes[-1].get_xlabel()
    finally:
        plt.close(fig)


def test_lifecycle_above_start_makes_one_tooth_a_large_share_of_its_panel():
    """Notebook 05's sawtooth: on one axis from zero a 300-byte tooth over a 1,000-byte start
    is faint; drawn above the start, each panel on its own axis, the tooth is most of it.
    Mutant: `base` left at 0 with above_start (the tooth stays under a quarter of the scale)."""
    stage3 = {**_run([1000 + 300 * (i % 3) for i in range(30)]), "start_bytes": 1000}
    stage0 = {**_run([9000 + 10 * (i % 2) for i in range(30)]), "start_bytes": 9000}
    fig = plots.lifecycle_timeline_figure({"stage 3": stage3, "stage 0": stage0}, unit=1,
                                          unit_name="B", above_start=True)
    try:
        axes = [ax for ax in fig.axes if ax.get_title(loc="left")]
        bottom, top = axes[0].get_ylim()
        assert 600 / (top - bottom) >= 0.2  # the tooth (0 to 600 bytes) against its scale
        assert "(starts at 1,000 B)" in axes[0].get_title(loc="left")
        assert axes[0].get_ylim() != axes[1].get_ylim()  # each panel its own scale
    finally:
        plt.close(fig)
