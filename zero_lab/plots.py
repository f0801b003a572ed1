"""Matplotlib figures for the notebooks, and the one place figures are saved.

Notebooks call `save_figure(fig, "name")`; the file lands in `runs/figures/` (or the folder
named by $ZERO_LAB_FIGURES_DIR) and `make figures` copies it into the committed `figures/`.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def figures_dir() -> Path:
    """Where notebooks write figures: $ZERO_LAB_FIGURES_DIR, else <repo>/runs/figures."""
    path = Path(os.environ.get("ZERO_LAB_FIGURES_DIR", REPO_ROOT / "runs" / "figures"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_figure(fig, name: str) -> Path:
    """Save `fig` as <figures_dir>/<name>.png (150 dpi, tight) and return the path."""
    if not name or "/" in name or name.endswith(".png"):
        raise ValueError(f"name must be a bare file stem like 'memory_per_stage', got {name!r}")
    path = figures_dir() / f"{name}.png"
    fig.savefig(path, dpi=150, bbox_inches="tight")
    return path


# ---- notebook 01: memory accounting ------------------------------------------------

STATE_COLORS = {
    "params": "#4C72B0",
    "grads": "#DD8452",
    "optimizer": "#55A868",
    "activations": "#C44E52",
}


def memory_stage_bars(rows, gpu_bytes=None, ax=None, unit=2**30, unit_name="GiB", title=None):
    """Stacked bar per ZeRO stage: params / grads / optimizer (/ activations) per rank.

    `rows` is a list of dicts with "stage" and any of the STATE_COLORS keys (bytes), e.g.
    from `zero_lab.memory.model_state_bytes`. A dashed line marks `gpu_bytes` if given.
    Returns the figure.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
    else:
        fig = ax.figure
    labels = [str(row.get("label", f"stage {row['stage']}")) for row in rows]
    bottoms = [0.0] * len(rows)
    for key, color in STATE_COLORS.items():
        values = [row.get(key, 0) / unit for row in rows]
        if not any(values):
            continue
        ax.bar(labels, values, bottom=bottoms, color=color, label=key)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for x, top in enumerate(bottoms):
        ax.annotate(f"{top:.3g}", (x, top), ha="center", va="bottom", fontsize=8)
    if gpu_bytes is not None:
        ax.axhline(gpu_bytes / unit, color="black", linestyle="--", linewidth=1)
        ax.annotate(f"GPU {gpu_bytes / unit:.3g} {unit_name}", (len(rows) - 0.5, gpu_bytes / unit),
                    ha="right", va="bottom", fontsize=8)
    ax.set_ylabel(f"{unit_name} per rank")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    return fig


# ---- notebook 02: collectives ------------------------------------------------------

OP_COLORS = {
    "all_reduce": "#4C72B0",
    "reduce_scatter": "#DD8452",
    "all_gather": "#55A868",
    "broadcast": "#8172B3",
}


def _ring_states(world_size: int):
    """Yield (title, state, received) for the start and every step of a ring all-reduce.

    state[r][c] is the set of ranks whose data chunk c on rank r contains; `received` the
    (rank, chunk) cells that changed in that step.
    """
    from zero_lab.collectives import ring_schedule

    n = world_size
    state = [[{r} for _ in range(n)] for r in range(n)]
    yield "start: rank r holds its own tensor", state, set()
    for i, step in enumerate(ring_schedule("all_reduce", n)):
        phase, k = ("reduce-scatter", i + 1) if i < n - 1 else ("all-gather", i - n + 2)
        new = [[set(cell) for cell in row] for row in state]
        for src, dst, chunk in step:
            if phase == "reduce-scatter":
                new[dst][chunk] |= state[src][chunk]  # the receiver adds its own part
            else:
                new[dst][chunk] = set(state[src][chunk])  # the receiver just stores it
        state = new
        yield f"{phase} step {k}", state, {(dst, chunk) for _, dst, chunk in step}


def ring_steps_figure(world_size: int = 4):
    """Grid per step of a ring all-reduce: rows are ranks, columns chunks, each cell says
    whose contributions it holds; red outlines mark what each rank received in that step."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n = world_size
    panels = list(_ring_states(n))
    cols = n
    rows = -(-(len(panels) + 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.5 * rows))
    axes = axes.ravel()
    cmap = plt.get_cmap("Blues")
    for ax, (title, state, received) in zip(axes, panels, strict=False):
        for r in range(n):
            for c in range(n):
                have = state[r][c]
                ax.add_patch(Rectangle((c, r), 1, 1, facecolor=cmap(0.15 + 0.7 * len(have) / n),
                                       edgecolor="white", linewidth=2))
                text = "Σ" if len(have) == n else "+".join(str(x) for x in sorted(have))
                ax.text(c + 0.5, r + 0.5, text, ha="center", va="center", fontsize=9,
                        color="white" if len(have) == n else "black")
                if (r, c) in received:
                    ax.add_patch(Rectangle((c + 0.05, r + 0.05), 0.9, 0.9, fill=False,
                                           edgecolor="#C44E52", linewidth=2))
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ax.set_xticks([c + 0.5 for c in range(n)], [f"c{c}" for c in range(n)], fontsize=8)
        ax.set_yticks([r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=8)
        ax.tick_params(length=0)
        ax.set_title(title, fontsize=9)
        for side in ax.spines.values():
            side.set_visible(False)
    for ax in axes[len(panels):]:
        ax.axis("off")
    axes[len(panels)].text(
        0.0, 0.5,
        f"N = {n} ranks, tensor cut in {n} chunks c0..c{n - 1}.\n"
        "Each step, rank r sends one chunk\nto rank r+1 (received: red outline).\n"
        f"Reduce-scatter: {n - 1} steps, then rank r\nholds the full sum Σ of chunk r.\n"
        f"All-gather: {n - 1} more steps.\n"
        f"Each rank sends 2(N-1) = {2 * (n - 1)} chunks\n= 2(N-1)/N of the tensor.",
        fontsize=8.5, va="center", transform=axes[len(panels)].transAxes)
    fig.suptitle(f"Ring all-reduce = reduce-scatter + all-gather (N = {n})", fontsize=11)
    fig.tight_layout()
    return fig


def alpha_beta_figure(timings, model, world_size: int | None = None):
    """Log-log time per call vs message size (points measured, lines the fitted model), and
    the bus bandwidth nccl-tests would report, per op."""
    import matplotlib.pyplot as plt
    import numpy as np

    from zero_lab.collectives import busbw

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    ops = [op for op in OP_COLORS if any(t["op"] == op for t in timings)]
    for op in ops:
        rows = sorted((t for t in timings if t["op"] == op), key=lambda t: t["nbytes"])
        n = world_size or rows[0]["world_size"]
        size = np.array([t["nbytes"] for t in rows], dtype=float)
        secs = np.array([t["seconds"] for t in rows])
        grid = np.geomspace(size.min(), size.max(), 100)
        fit = np.array([model.predict(op, s, n) for s in grid])
        color = OP_COLORS[op]
        ab = model.per_op.get(op, model.pooled)
        label = f"{op}: α={ab.alpha * 1e6:.0f} µs, β={ab.beta / 1e9:.2f} GB/s"
        ax_t.loglog(size, secs, "o", color=color, markersize=4)
        ax_t.loglog(grid, fit, "-", color=color, linewidth=1.2, label=label)
        ax_b.semilogx(size, [busbw(op, s, t, n) / 1e9 for s, t in zip(size, secs, strict=True)],
                      "o", color=color, markersize=4)
        ax_b.semilogx(grid, [busbw(op, s, t, n) / 1e9 for s, t in zip(grid, fit, strict=True)],
                      "-", color=color, linewidth=1.2, label=op)
    ax_t.set_xlabel("message size (bytes)")
    ax_t.set_ylabel("seconds per call")
    ax_t.set_title("latency-bound (flat) to bandwidth-bound (slope 1)", fontsize=10)
    ax_t.legend(fontsize=7.5)
    ax_b.set_xlabel("message size (bytes)")
    ax_b.set_ylabel("bus bandwidth (GB/s)")
    ax_b.set_title("busbw = size / time x bus factor (nccl-tests)", fontsize=10)
    ax_b.legend(fontsize=7.5)
    for ax in (ax_t, ax_b):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig
