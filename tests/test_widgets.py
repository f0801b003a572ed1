"""zero_lab.widgets: the calculator's logic, without a browser."""

from __future__ import annotations

import inspect

import matplotlib.pyplot as plt
import pytest

from zero_lab import memory, plots, widgets

GiB = 2**30


def test_stage_rows_model_states_match_memory_and_activations_are_shared():
    rows = widgets.stage_rows(7.5e9, 64, "mixed", "adam", seq_len=2048, micro_batch=2,
                              checkpointing="full")
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    shape = memory.gpt_shape(7.5e9)
    act = memory.activation_bytes(shape["n_layers"], 2048, 2, shape["hidden"], shape["heads"],
                                  "full")
    for row in rows:
        states = memory.model_state_bytes(7.5e9, row["stage"], 64)
        assert {k: row[k] for k in ("params", "grads", "optimizer")} == {
            k: states[k] for k in ("params", "grads", "optimizer")
        }
        assert row["activations"] == act  # data parallelism does not shard activations
        assert row["total"] == states["total"] + act


def test_calculator_state_verdicts_and_largest_models():
    state = widgets.calculator_state(70e9, 64, 3, "mixed", "adam", gpu_gib=80, seq_len=4096,
                                     micro_batch=1, checkpointing="full")
    fits = {r["stage"]: r["fits"] for r in state["rows"]}
    assert fits == {0: False, 1: False, 2: False, 3: True}
    assert all(r["fits"] == (r["total"] <= 80 * GiB) for r in state["rows"])
    assert state["selected"]["stage"] == 3
    assert state["largest"] == {s: memory.largest_model(80 * GiB, 64, s) for s in range(4)}


def test_verdict_lines_say_fit_or_not():
    fits = widgets.verdict_lines(widgets.calculator_state(1e9, 8, 3, "mixed", "adam", 80))
    assert "-> fits in 80 GiB" in fits[0]
    too_big = widgets.verdict_lines(widgets.calculator_state(1e12, 8, 0, "fp32", "adam", 80))
    assert "does NOT fit" in too_big[0]
    assert "stage 0: 5.37B" in too_big[2]  # 80 GiB / 16 bytes
    assert f"{memory.largest_model(80 * GiB, 8, 0) / 1e9:.3g}B" == "5.37B"


def test_memory_stage_bars_draws_every_state_and_the_gpu_line():
    rows = widgets.stage_rows(7.5e9, 64)
    fig = plots.memory_stage_bars(rows, gpu_bytes=80 * GiB)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["params", "grads", "optimizer", "activations"]
    assert len(ax.patches) == 4 * 4  # four stacked segments for each of four stages
    heights = [sum(p.get_height() for p in ax.patches[i::4]) for i in range(4)]
    assert heights == pytest.approx([r["total"] / GiB for r in rows])
    assert any(line.get_ydata()[0] == 80 for line in ax.get_lines())
    plt.close(fig)


def test_memory_calculator_builds_and_updates(capsys):
    box = widgets.memory_calculator(n_params=1e9, world_size=8, stage=2, gpu_gib=40)
    params = set(inspect.signature(widgets.calculator_state).parameters)
    assert set(box.controls) == params  # every control feeds calculator_state by name
    capsys.readouterr()
    box.controls["n_params"].value = 1e12
    out = capsys.readouterr().out  # outside a kernel the Output widget passes prints through
    assert "stage 2:" in out and "does NOT fit in 40 GiB" in out
    plt.close("all")
