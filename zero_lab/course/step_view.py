"""One training step, phase by phase, as every rank held it: a figure and an interactive view.

The ranks' records come from zero_lab/workers/step_record.py (zero_lab/course/step_record.py
says what is recorded: real tensors, every rank). For one system and phase, `phase_grid`
lays them out as a grid: three rows a rank (parameters, gradient, Adam's first moment), one
column an element of the flat buffer, the padding last. `phase_figure` draws it: a coloured
cell is held, an empty one is not; a gradient is pale while it is this rank's own and dark
once averaged over the ranks; a black frame marks the slice the rank owns. `step_figure`
puts a system's phases side by side; `step_view` steps through them with buttons (a
system picker, Previous / Next), the model of notebook 02's ring figure, on recorded data.

tests/test_step_view.py checks the grids against the records; tests/test_browser.py clicks
Next in a real page through the CSS classes (zero-lab-step-next, zero-lab-step-title,
zero-lab-step-image).
"""

from __future__ import annotations

ROWS = ("parameters", "gradient", "Adam m")
NAMES = {"ddp": "DDP", "stage1": "ZeRO-1", "stage2": "ZeRO-2", "stage3": "ZeRO-3"}
COLOURS = {"parameters": "#4C72B0", "local": "#F2B880", "mean": "#DD8452",
           "Adam m": "#55A868"}
KEY = ("coloured: held, empty: not held · pale gradient: this rank's batch's, dark: averaged "
       "over the ranks · framed: the slice the rank owns · hatched: padding")


def phases(records: list[dict], system: str) -> list[str]:
    """The names of `system`'s recorded phases, in order."""
    if system not in records[0]["systems"]:
        raise ValueError(f"system {system!r} is not recorded: "
                         f"{sorted(records[0]['systems'])}")
    return [p["name"] for p in records[0]["systems"][system]]


def phase_grid(records: list[dict], system: str, phase: int) -> list[list[tuple]]:
    """Rows (rank by rank: parameters, gradient, Adam m) of cells (value or None, colour key)."""
    n = len(phases(records, system))
    if not 0 <= phase < n:
        raise ValueError(f"phase must be 0..{n - 1} for {system}, got {phase}")
    grid = []
    for rank in records:
        rec = rank["systems"][system][phase]
        grads = rec["grads"]
        owned = rec["owned"]
        for row, values in zip(ROWS, (rec["params"], grads, rec["state"]), strict=True):
            cells = []
            for i, v in enumerate(values):
                key = row
                if row == "gradient":
                    mean = rec["grad_kind"] == "mean" or (
                        rec["grad_kind"] == "mean_slice" and owned and owned[0] <= i < owned[1])
                    key = "mean" if mean else "local"
                cells.append((v, key))
            grid.append(cells)
    return grid


def held_bytes(records: list[dict], system: str, phase: int) -> list[int]:
    """Bytes each rank holds in the phase (8 a float64 element of the three buffers)."""
    grid = phase_grid(records, system, phase)
    return [8 * sum(v is not None for row in grid[3 * r:3 * r + 3] for v, _ in row)
            for r in range(len(records))]


def _title(records: list[dict], system: str, phase: int) -> str:
    rec = records[0]["systems"][system][phase]
    said = f"{NAMES[system]}, phase {phase + 1}: {rec['name']}"
    if rec["message"]:
        op = rec["message"]["op"].replace("_", "-")
        said += f"\n{op}: each rank sends {rec['message']['sent']} B"
    held = held_bytes(records, system, phase)
    return said + f"\nheld: {', '.join(f'rank {r} {b} B' for r, b in enumerate(held))}"


def _draw(ax, records: list[dict], system: str, phase: int, labels: bool = True) -> None:
    from matplotlib.patches import Rectangle

    grid = phase_grid(records, system, phase)
    numel, padded = records[0]["numel"], records[0]["padded"]
    for y, row in enumerate(grid):
        rank, kind = divmod(y, 3)
        top = y + rank * 0.5  # a gap between ranks
        for x, (value, key) in enumerate(row):
            face = COLOURS[key] if value is not None else "white"
            ax.add_patch(Rectangle((x, top), 1, 1, facecolor=face, edgecolor="#DDDDDD",
                                   hatch="//" if x >= numel else None))
            if value is not None and labels:
                ax.text(x + 0.5, top + 0.5, f"{value:.2f}", ha="center", va="center",
                        fontsize=5.5, color="white" if key in ("parameters", "mean",
                                                               "Adam m") else "black")
        owned = records[rank]["systems"][system][phase]["owned"]
        if owned and kind == 2:
            ax.add_patch(Rectangle((owned[0], top - 2), owned[1] - owned[0], 3, fill=False,
                                   edgecolor="black", linewidth=1.5))
    ranks = len(records)
    ax.set_xlim(0, padded)
    ax.set_ylim(ranks * 3.5 - 0.5, 0)
    ax.set_yticks([y + 0.5 + (y // 3) * 0.5 for y in range(3 * ranks)],
                  [f"rank {y // 3} {ROWS[y % 3]}" if y % 3 == 0 else ROWS[y % 3]
                   for y in range(3 * ranks)], fontsize=7)
    ax.set_xticks([numel + (padded - numel) / 2] if padded > numel else [],
                  ["padding"] if padded > numel else [], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)


def phase_figure(records: list[dict], system: str, phase: int, titled: bool = True):
    """One phase of one system: every rank's three buffers (`titled`: what the phase did)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.62 * 3 * len(records)))
    _draw(ax, records, system, phase)
    if titled:
        ax.set_title(_title(records, system, phase), fontsize=9, loc="left")
    fig.text(0.01, 0.005, KEY, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def step_figure(records: list[dict], system: str):
    """All of `system`'s phases side by side (values left out: the pattern is the lesson)."""
    import matplotlib.pyplot as plt

    names = phases(records, system)
    fig, axes = plt.subplots(1, len(names), figsize=(2.9 * len(names),
                                                      0.8 + 0.45 * 3 * len(records)))
    for phase, ax in enumerate(axes):
        _draw(ax, records, system, phase, labels=False)
        if phase:
            ax.set_yticks([])
        ax.set_title("\n".join(_title(records, system, phase).split("\n")[:2])
                     .replace(f"{NAMES[system]}, ", ""), fontsize=7, loc="left")
    fig.suptitle(f"One step of {NAMES[system]} on {len(records)} ranks "
                 f"({records[0]['numel']} parameters)", fontsize=10)
    fig.text(0.01, 0.005, KEY, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def step_view(records: list[dict], system: str = "stage1"):
    """Buttons over the recorded step: pick a system, then Previous / Next through its phases.
    The picture is an Image replaced whole at each click, as the memory calculator's is."""
    import ipywidgets as w

    from zero_lab.course.plots import png_bytes

    picker = w.ToggleButtons(options=[(NAMES[s], s) for s in records[0]["systems"]],
                             value=system)
    back, forward = w.Button(description="Previous"), w.Button(description="Next")
    forward.add_class("zero-lab-step-next")
    title = w.HTML()
    title.add_class("zero-lab-step-title")
    image = w.Image(format="png", layout=w.Layout(width="820px"))
    image.add_class("zero-lab-step-image")
    at = {"phase": 0}

    def draw(_=None):
        count = len(phases(records, picker.value))
        at["phase"] = min(max(at["phase"], 0), count - 1)
        back.disabled, forward.disabled = at["phase"] == 0, at["phase"] == count - 1
        title.value = "<br>".join(_title(records, picker.value, at["phase"]).split("\n"))
        # the title is the HTML line beside the buttons
        image.value = png_bytes(phase_figure(records, picker.value, at["phase"], titled=False))

    def step(by):
        def click(_):
            at["phase"] += by
            draw()
        return click

    def restart(_):
        at["phase"] = 0
        draw()

    back.on_click(step(-1))
    forward.on_click(step(+1))
    picker.observe(restart, names="value")
    draw()
    box = w.VBox([picker, w.HBox([back, forward, title]), image])
    box.picker, box.back, box.forward, box.title, box.image = picker, back, forward, title, image
    return box
