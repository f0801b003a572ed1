"""Interactive memory calculator for the notebooks (ipywidgets + matplotlib).

The arithmetic lives in plain functions (`calculator_state`, `verdict_lines`) so tests
run it without a browser; `memory_calculator()` only wires sliders to them and draws
`zero_lab.plots.memory_stage_bars`.
"""

from __future__ import annotations

from zero_lab import memory

GiB = memory.GiB
WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


def stage_rows(
    n_params: float,
    world_size: int,
    precision: str = "mixed",
    optimizer: str = "adam",
    seq_len: int = 2048,
    micro_batch: int = 1,
    checkpointing: str = "full",
) -> list[dict]:
    """Per-rank bytes for stages 0-3: model states plus activations of a GPT-shaped model.

    Activations come from `memory.activation_bytes` for `memory.gpt_shape(n_params)`; ZeRO
    data parallelism does not shard them (each rank keeps its own micro-batch's), so they
    are the same for every stage.
    """
    n = int(round(n_params))
    shape = memory.gpt_shape(n)
    activations = memory.activation_bytes(
        shape["n_layers"], seq_len, micro_batch, shape["hidden"], shape["heads"], checkpointing
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
) -> dict:
    """Everything the calculator shows, as data: rows, fits per stage, largest models."""
    gpu_bytes = gpu_gib * GiB
    rows = stage_rows(n_params, world_size, precision, optimizer, seq_len, micro_batch,
                      checkpointing)
    for row in rows:
        row["fits"] = row["total"] <= gpu_bytes
    largest = {
        s: memory.largest_model(gpu_bytes, world_size, s, precision, optimizer)
        for s in memory.STAGES
    }
    return {
        "rows": rows,
        "selected": rows[stage],
        "gpu_bytes": gpu_bytes,
        "largest": largest,
        "shape": memory.gpt_shape(int(round(n_params))),
    }


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def verdict_lines(state: dict) -> list[str]:
    """Human-readable verdict for the selected stage, then the largest model per stage."""
    row, gpu = state["selected"], state["gpu_bytes"]
    shape = state["shape"]
    word = "fits" if row["fits"] else "does NOT fit"
    lines = [
        f"stage {row['stage']}: {row['total'] / GiB:.2f} GiB per rank "
        f"(model states {(row['total'] - row['activations']) / GiB:.2f} + activations "
        f"{row['activations'] / GiB:.2f}) -> {word} in {gpu / GiB:.0f} GiB",
        f"activations assume a GPT shape of {shape['n_layers']} layers x hidden "
        f"{shape['hidden']} ({shape['heads']} heads)",
        "largest model whose model states fit (activations excluded, as in the paper): "
        + ", ".join(f"stage {s}: {_count(n)}" for s, n in state["largest"].items()),
    ]
    return lines


def memory_calculator(
    n_params: float = 7.5e9,
    world_size: int = 64,
    stage: int = 3,
    precision: str = "mixed",
    optimizer: str = "adam",
    gpu_gib: float = 80.0,
):
    """Build the interactive calculator: an ipywidgets.VBox (display it as a cell's result).

    The box's `.controls` dict maps argument names of `calculator_state` to their widgets.
    """
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from zero_lab.plots import memory_stage_bars

    style = {"description_width": "130px"}
    layout = w.Layout(width="480px")
    controls = {
        "n_params": w.FloatLogSlider(value=n_params, base=10, min=8, max=12, step=0.05,
                                     description="parameters Ψ", readout_format=".3g",
                                     style=style, layout=layout),
        "world_size": w.SelectionSlider(options=WORLD_SIZES, value=world_size,
                                        description="world size N_d", style=style,
                                        layout=layout),
        "stage": w.ToggleButtons(options=list(memory.STAGES), value=stage, description="stage",
                                 style=style),
        "precision": w.Dropdown(options=memory.PRECISIONS, value=precision,
                                description="precision", style=style),
        "optimizer": w.Dropdown(options=memory.OPTIMIZERS, value=optimizer,
                                description="optimizer", style=style),
        "gpu_gib": w.FloatSlider(value=gpu_gib, min=8, max=192, step=8,
                                 description="GPU memory (GiB)", style=style, layout=layout),
        "seq_len": w.SelectionSlider(options=SEQ_LENS, value=2048, description="sequence length",
                                     style=style, layout=layout),
        "micro_batch": w.IntSlider(value=1, min=1, max=32, description="micro-batch",
                                   style=style, layout=layout),
        "checkpointing": w.Dropdown(options=memory.CHECKPOINTING, value="full",
                                    description="activation ckpt", style=style),
    }
    out = w.Output()

    def update(**values):
        state = calculator_state(**values)
        with out:
            out.clear_output(wait=True)
            fig = memory_stage_bars(state["rows"], state["gpu_bytes"],
                                    title=f"Ψ = {_count(values['n_params'])}, "
                                    f"N_d = {values['world_size']}")
            display(fig)
            plt.close(fig)
            print("\n".join(verdict_lines(state)))

    w.interactive_output(update, controls)
    box = w.VBox([w.HBox([w.VBox(list(controls.values())[:6]),
                          w.VBox(list(controls.values())[6:])]), out])
    box.controls = controls
    return box
