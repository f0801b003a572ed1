"""Interactive memory calculator for the notebooks (ipywidgets + matplotlib).

The arithmetic lives in plain functions (`calculator_state`, `verdict_lines`) so tests
run it without a browser; `memory_calculator()` only wires the controls to them and draws
`zero_lab.course.plots.memory_stage_bars` into an image. tests/test_browser.py checks the widget in
a real page through the CSS classes it sets (zero-lab-params, zero-lab-world-size,
zero-lab-chart, zero-lab-verdict).

The course's at-scale models (zero_lab/course/models.py) are offered by name, their
activations priced on their published shapes; any other Ψ gets `memory.gpt_shape`'s guess.
"""

from __future__ import annotations

import html

from zero_lab import memory
from zero_lab.course import models
from zero_lab.course.formatting import model_size
from zero_lab.predict.projection import RESERVE_FRACTION

GiB = memory.GiB
# The course's two at-scale models, by name, among round sizes from 1B to 1T to try another Ψ:
# a slider over listed sizes reads "Llama 3 70B", where a log slider would read and snap to
# 7.08e+10.
NAMED = {models.PSI_8B: "Llama 3.1 8B", models.PSI_70B: "Llama 3 70B"}
SHAPES = {models.PSI_8B: models.LLAMA3_8B, models.PSI_70B: models.LLAMA3_70B}
MODEL_SIZES = tuple(sorted({*NAMED, *(2**k * 10**9 for k in (0, 1, 2, 4, 5, 7, 8, 9)), 10**12}))
WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


def model_label(n_params: float) -> str:
    """"Llama 3 70B" for the course's at-scale models, else the size as people say it."""
    return NAMED.get(n_params) or model_size(n_params)


def model_shape(n_params: float) -> dict[str, int]:
    """{"n_layers", "hidden", "heads", ...}: the published shape of a named model (Llama's
    config.json), else `memory.gpt_shape`'s GPT-3-like guess for Ψ."""
    if n_params in SHAPES:
        return dict(SHAPES[n_params])
    return memory.gpt_shape(int(round(n_params)))


def stage_rows(
    n_params: float,
    world_size: int,
    precision: str = "mixed",
    optimizer: str = "adam",
    seq_len: int = 2048,
    micro_batch: int = 1,
    checkpointing: str = "full",
    attention: str = "fused",
) -> list[dict]:
    """Per-rank bytes for stages 0-3: model states plus activations of a transformer.

    Activations come from `memory.activation_bytes` (Korthikanti's per-layer count) for
    `model_shape(n_params)`: Llama's published shape for the named models, else a GPT shape,
    with the attention kernel named (notebooks 01, 07 and 08 assume the fused one); ZeRO data
    parallelism does not shard them (each rank keeps its own micro-batch's), so they are the
    same for every stage.
    """
    n = int(round(n_params))
    shape = model_shape(n_params)
    activations = memory.activation_bytes(
        shape["n_layers"], seq_len, micro_batch, shape["hidden"], shape["heads"], checkpointing,
        attention=attention,
    )
    rows = []
    by_stage = memory.state_breakdown_by_stage(n, world_size, precision, optimizer)
    for stage, states in by_stage.items():
        row = {"stage": stage, **states, "activations": activations}
        row["total"] = states["total"] + activations
        rows.append(row)
    return rows


def calculator_state(
    n_params: float,
    world_size: int,
    stage: int,
    precision: str,
    optimizer: str,
    gpu_gib: float,
    seq_len: int = 2048,
    micro_batch: int = 1,
    checkpointing: str = "full",
    attention: str = "fused",
    reserve_fraction: float = RESERVE_FRACTION,
) -> dict:
    """Everything the calculator shows, as data: rows, fits per stage, largest models.

    A stage fits when its bytes leave `reserve_fraction` of the GPU free (notebook 07's
    reserve: the CUDA context, NCCL's buffers, the allocator's cache and fragmentation)."""
    gpu_bytes = gpu_gib * GiB
    rows = stage_rows(n_params, world_size, precision, optimizer, seq_len, micro_batch,
                      checkpointing, attention)
    for row in rows:
        row["fits"] = row["total"] <= (1 - reserve_fraction) * gpu_bytes
    largest = {
        s: memory.largest_model(gpu_bytes, world_size, s, precision, optimizer)
        for s in memory.STAGES
    }
    return {
        "rows": rows,
        "selected": rows[stage],
        "gpu_bytes": gpu_bytes,
        "reserve_fraction": reserve_fraction,
        "attention": attention,
        "largest": largest,
        "shape": model_shape(n_params),
    }


def verdict_lines(state: dict) -> list[str]:
    """Human-readable verdict: every stage's per-rank total and whether it fits, the
    selected stage's split into model states and activations, the GPT shape assumed for
    activations, and the largest model per stage."""
    row, gpu = state["selected"], state["gpu_bytes"]
    shape = state["shape"]
    lines = [f"stage {r['stage']}: {r['total'] / GiB:.2f} GiB per rank -> "
             f"{'fits' if r['fits'] else 'does NOT fit'}" for r in state["rows"]]
    lines += [
        f"selected stage {row['stage']}: model states "
        f"{(row['total'] - row['activations']) / GiB:.2f} GiB + activations "
        f"{row['activations'] / GiB:.2f} GiB "
        f"-> {'fits' if row['fits'] else 'does NOT fit'} in {gpu / GiB:.0f} GiB",
        f"activations: {shape['n_layers']} layers x hidden {shape['hidden']} "
        f"({shape['heads']} heads), {state['attention']} attention; fits: leaves a "
        f"{state['reserve_fraction']:.0%} reserve",
        "largest model whose model states fit (activations excluded, as in the paper):",
        "  " + ", ".join(f"stage {s}: {model_size(n)}" for s, n in state["largest"].items()),
    ]
    return lines


def _with(options: tuple, value) -> list:
    """`options` plus `value`, sorted: a default the list lacks is added, never snapped to a
    neighbour (a snapped value would be sent back by the browser and redraw the widget)."""
    return sorted(set(options) | {value})


def memory_calculator(
    n_params: float = models.PSI_8B,
    world_size: int = 8,
    stage: int = 3,
    precision: str = "mixed",
    optimizer: str = "adam",
    gpu_gib: float = 80.0,
    seq_len: int = 2048,
    micro_batch: int = 1,
    checkpointing: str = "full",
    attention: str = "fused",
    reserve_fraction: float = RESERVE_FRACTION,
):
    """Build the interactive calculator: an ipywidgets.VBox (display it as a cell's result).

    The box's `.controls` dict maps argument names of `calculator_state` to their widgets.
    The chart is an `Image` widget holding a PNG and the verdict an `HTML` widget, both
    replaced whole on every change: the page always shows one complete chart (an `Output`
    widget cleared and redrawn could show a blank one while two updates raced).
    """
    import ipywidgets as w

    style = {"description_width": "130px"}
    layout = w.Layout(width="480px")
    controls = {
        "n_params": w.SelectionSlider(
            options=[(model_label(n), n) for n in _with(MODEL_SIZES, n_params)], value=n_params,
            description="parameters Ψ", style=style, layout=layout),
        "world_size": w.SelectionSlider(options=_with(WORLD_SIZES, world_size), value=world_size,
                                        description="world size N_d", style=style,
                                        layout=layout),
        "stage": w.ToggleButtons(options=list(memory.STAGES), value=stage, description="stage",
                                 style={**style, "button_width": "48px"}, layout=layout),
        "precision": w.Dropdown(options=memory.PRECISIONS, value=precision,
                                description="precision", style=style),
        "optimizer": w.Dropdown(options=memory.OPTIMIZERS, value=optimizer,
                                description="optimizer", style=style),
        "gpu_gib": w.FloatSlider(value=gpu_gib, min=8, max=192, step=8,
                                 description="GPU memory (GiB)", style=style, layout=layout),
        "seq_len": w.SelectionSlider(options=_with(SEQ_LENS, seq_len), value=seq_len,
                                     description="sequence length", style=style, layout=layout),
        "micro_batch": w.IntSlider(value=micro_batch, min=1, max=32, description="micro-batch",
                                   style=style, layout=layout),
        "checkpointing": w.Dropdown(options=memory.CHECKPOINTING, value=checkpointing,
                                    description="activation ckpt", style=style),
        "attention": w.Dropdown(options=memory.ATTENTION, value=attention,
                                description="attention kernel", style=style),
        "reserve_fraction": w.FloatSlider(value=reserve_fraction, min=0.0, max=0.3, step=0.05,
                                          description="reserve (of GPU)", style=style,
                                          layout=layout, readout_format=".0%"),
    }
    controls["n_params"].add_class("zero-lab-params")
    controls["world_size"].add_class("zero-lab-world-size")
    chart = w.Image(format="png", layout=w.Layout(width="740px"))
    chart.add_class("zero-lab-chart")
    verdict = w.HTML()
    verdict.add_class("zero-lab-verdict")

    def update(_change=None):
        values = {name: control.value for name, control in controls.items()}
        state = calculator_state(**values)
        chart.value = chart_png(state, values)
        verdict.value = "<pre>" + html.escape("\n".join(verdict_lines(state))) + "</pre>"

    for control in controls.values():
        control.observe(update, names="value")
    update()  # drawn before the box is shown: the first render is complete
    box = w.VBox([w.HBox([w.VBox(list(controls.values())[:6]),
                          w.VBox(list(controls.values())[6:])]), chart, verdict])
    box.controls, box.chart, box.verdict = controls, chart, verdict
    return box


def chart_png(state: dict, values: dict) -> bytes:
    """The calculator's bar chart for `state` as PNG bytes."""
    from zero_lab.course.plots import memory_stage_bars, png_bytes

    n_params = values["n_params"]
    model = NAMED.get(n_params) or f"Ψ = {model_size(n_params)}"
    return png_bytes(memory_stage_bars(
        state["rows"], state["gpu_bytes"],
        title=f"{model}, N_d = {values['world_size']}, "
        f"sequence {values['seq_len']} x micro-batch {values['micro_batch']}, "
        f"checkpointing: {values['checkpointing']}"))
