"""zero_lab.course.widgets: the calculator's logic, without a browser."""

from __future__ import annotations

import inspect

import matplotlib.pyplot as plt
import pytest

from zero_lab import memory
from zero_lab.course import models, plots, widgets

GiB = 2**30


def test_stage_rows_model_states_match_memory_and_activations_are_shared():
    rows = widgets.stage_rows(7.5e9, 64, "mixed", "adam", seq_len=2048, micro_batch=2,
                              checkpointing="full")
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    shape = memory.gpt_shape(7.5e9)
    act = memory.activation_bytes(shape["n_layers"], 2048, 2, shape["hidden"], shape["heads"],
                                  "full", attention="fused")  # notebooks 01, 07, 08's kernel
    for row in rows:
        states = memory.model_state_bytes(7.5e9, row["stage"], 64)
        assert {k: row[k] for k in ("params", "grads", "optimizer")} == {
            k: states[k] for k in ("params", "grads", "optimizer")
        }
        assert row["activations"] == act  # data parallelism does not shard activations
        assert row["total"] == states["total"] + act


def test_the_at_scale_models_are_offered_by_name_with_their_published_shapes():
    for psi, name, shape in ((models.PSI_8B, "Llama 3.1 8B", models.LLAMA3_8B),
                             (models.PSI_70B, "Llama 3 70B", models.LLAMA3_70B)):
        assert psi in widgets.MODEL_SIZES and widgets.model_label(psi) == name
        state = widgets.calculator_state(psi, 8, 3, "mixed", "adam", 80, seq_len=4096)
        assert {k: state["shape"][k] for k in ("n_layers", "hidden", "heads")} == {
            k: shape[k] for k in ("n_layers", "hidden", "heads")}
        assert state["selected"]["activations"] == memory.activation_bytes(
            shape["n_layers"], 4096, 1, shape["hidden"], shape["heads"], "full",
            attention="fused")
    # Llama 3 70B's 80 layers of 8192, not the 71 of 9088 a GPT-3-like guess gives its Ψ
    assert memory.gpt_shape(models.PSI_70B)["n_layers"] != models.LLAMA3_70B["n_layers"]
    # another Ψ: a size, its activations from memory.gpt_shape
    assert widgets.model_label(16e9) == "16B"
    assert widgets.model_shape(16e9) == memory.gpt_shape(16e9)
    assert not any(label.startswith(("7B", "13B", "175B"))
                   for label in map(widgets.model_label, widgets.MODEL_SIZES))


def test_calculator_state_verdicts_and_largest_models():
    state = widgets.calculator_state(models.PSI_70B, 64, 3, "mixed", "adam", gpu_gib=80,
                                     seq_len=4096, micro_batch=1, checkpointing="full")
    fits = {r["stage"]: r["fits"] for r in state["rows"]}
    assert fits == {0: False, 1: False, 2: False, 3: True}
    # fits: leaves notebook 07's reserve free (projection.RESERVE_FRACTION, 10%)
    assert all(r["fits"] == (r["total"] <= 0.9 * 80 * GiB) for r in state["rows"])
    assert state["selected"]["stage"] == 3
    assert state["largest"] == {s: memory.largest_model(80 * GiB, 64, s) for s in range(4)}


def test_verdict_lines_say_fit_or_not_for_every_stage():
    lines = widgets.verdict_lines(widgets.calculator_state(1e9, 8, 3, "mixed", "adam", 80))
    assert lines[:4] == [f"stage {r['stage']}: {r['total'] / GiB:.2f} GiB per rank -> fits"
                         for r in widgets.calculator_state(1e9, 8, 3, "mixed", "adam",
                                                           80)["rows"]]
    assert lines[4].startswith("selected stage 3:") and lines[4].endswith("-> fits in 80 GiB")
    too_big = widgets.verdict_lines(widgets.calculator_state(1e12, 8, 0, "fp32", "adam", 80))
    assert too_big[0].endswith("-> does NOT fit") and "does NOT fit" in too_big[4]
    assert "stage 0: 5.37B" in too_big[7]  # 80 GiB / 16 bytes
    assert max(map(len, lines)) <= 100  # no line wraps in the widget's box or a cell
    assert f"{memory.largest_model(80 * GiB, 8, 0) / 1e9:.3g}B" == "5.37B"


def test_memory_stage_bars_draws_every_state_and_the_gpu_line():
    rows = widgets.stage_rows(7.5e9, 64)
    fig = plots.memory_stage_bars(rows, gpu_bytes=80 * GiB)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["activations", "optimizer", "grads", "params", "GPU: 80 GiB"]  # as stacked
    assert len(ax.patches) == 4 * 4  # four stacked segments for each of four stages
    heights = [sum(p.get_height() for p in ax.patches[i::4]) for i in range(4)]
    assert heights == pytest.approx([r["total"] / GiB for r in rows])
    assert any(line.get_ydata()[0] == 80 for line in ax.get_lines())
    plt.close(fig)


def _pixel_spread(png: bytes) -> float:
    from io import BytesIO

    from PIL import Image, ImageStat

    return max(ImageStat.Stat(Image.open(BytesIO(png)).convert("L")).stddev)


def _text(html_widget) -> str:
    import html

    return html.unescape(html_widget.value)


def test_memory_calculator_builds_and_updates():
    box = widgets.memory_calculator(n_params=1e9, world_size=8, stage=2, gpu_gib=40)
    params = set(inspect.signature(widgets.calculator_state).parameters)
    assert set(box.controls) == params  # every control feeds calculator_state by name
    assert "selected stage 2: " in _text(box.verdict) and "-> fits" in _text(box.verdict)
    first_chart = box.chart.value
    assert _pixel_spread(first_chart) > 20  # drawn at construction, and not blank
    box.controls["n_params"].value = 1e12
    assert "does NOT fit in 40 GiB" in _text(box.verdict)
    assert box.chart.value != first_chart and _pixel_spread(box.chart.value) > 20
    before = _text(box.verdict)
    box.controls["world_size"].value = 1024
    assert _text(box.verdict) != before  # stages 1-3 hold less per rank at N_d = 1024
    assert _pixel_spread(box.chart.value) > 20


def test_calculator_keeps_its_defaults_exactly_and_names_them_as_people_do():
    # 70e9 was not a point of the old log slider: the browser snapped it to 7.08e10 and sent
    # it back, which redrew the chart blank and showed a 70.8B model under a 70B heading
    box = widgets.memory_calculator(n_params=models.PSI_70B, world_size=64, stage=3,
                                    seq_len=4096)
    values = {name: c.value for name, c in box.controls.items()}
    assert values["n_params"] == models.PSI_70B and values["seq_len"] == 4096
    assert box.controls["n_params"].label == "Llama 3 70B"
    odd = widgets.memory_calculator(n_params=3.3e9, world_size=24)  # not in the lists: added
    assert odd.controls["n_params"].value == 3.3e9 and odd.controls["world_size"].value == 24
    assert odd.controls["n_params"].label == "3.3B"
    assert "zero-lab-chart" in box.chart._dom_classes  # tests/test_browser.py finds it so


def test_stage_bar_labels_are_plain_numbers_and_the_legend_covers_no_bar():
    rows = widgets.stage_rows(models.PSI_70B, 1)
    fig = plots.memory_stage_bars(rows, gpu_bytes=80 * GiB)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.texts]
    assert labels and not any("e+" in t for t in labels), labels
    assert labels[0] == f"{rows[0]['total'] / GiB:,.0f}"  # 1,000 GiB and more: "1,053"
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # outside the axes, right of the bars
    assert ax.get_ylim()[1] > max(p.get_y() + p.get_height() for p in ax.patches)
    plt.close(fig)
