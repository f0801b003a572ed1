"""Figures of notebook 07: per-rank memory against N (measured and the formula, log axes),
activations against the model states per rank, and the projected step time against N per
stage and link or machine. Parent side.

Memory is drawn in MiB (2**20 bytes) unless a figure is given another unit; times in ms. The
projected curves are lower bounds (exposed communication only, `zero_lab.predict.projection`); the
dots are steps measured on this machine."""

from __future__ import annotations

STAGE_COLORS = {0: "#4C72B0", 1: "#DD8452", 2: "#55A868", 3: "#C44E52"}


def memory_vs_world_figure(rows: list[dict], title: str, unit=2**20, unit_name="MiB"):
    """Per stage: `memory.model_state_bytes` as a line, the bytes rank 0 measurably held
    as dots, and the step's peak as crosses; both axes logarithmic."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for stage in sorted({r["stage"] for r in rows}):
        mine = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["world_size"])
        n = [r["world_size"] for r in mine]
        color = STAGE_COLORS[stage]
        ax.plot(n, [r["predicted"] / unit for r in mine], "-", color=color, alpha=0.6,
                label=f"stage {stage}: formula")
        ax.plot(n, [r["held"]["total"] / unit for r in mine], "o", color=color,
                label=f"stage {stage}: held (measured)")
        ax.plot(n, [r["peak"] / unit for r in mine], "x", color=color, markersize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size N (rank 0 of N, fake process group)")
    ax.set_ylabel(f"{unit_name} on rank 0")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2, title="x = peak during a step", title_fontsize=7)
    ax.grid(True, which="both", alpha=0.25)
    fig.tight_layout()
    return fig


def projected_time_figure(curves: dict[str, dict[int, list[tuple[int, float]]]],
                          measured: dict[int, list[tuple[int, float]]] | None = None,
                          title: str = "Projected step time per stage",
                          terms: dict[str, dict[str, list[tuple[int, float]]]] | None = None):
    """One panel per link, two panels a row: projected step time against N for each stage
    (lines, drawn only as far as the link reaches); with `measured` ({stage: [(N, seconds)]}),
    this machine's measured steps as dots on the first panel; with `terms` ({link: {"latency":
    [(N, s)], "bandwidth": [(N, s)]}}), stage 3's communication split into its two terms, grey.
    Log axes, ticks as plain numbers."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    rows = -(-len(curves) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(10, 3.6 * rows), squeeze=False)
    for i, (ax, (link, by_stage)) in enumerate(zip(axes.flat, curves.items(), strict=False)):
        for stage, points in sorted(by_stage.items()):
            ax.plot([n for n, _ in points], [t * 1e3 for _, t in points], "-",
                    color=STAGE_COLORS[stage], label=f"stage {stage}")
        for style, (term, points) in zip(("--", ":"), (terms or {}).get(link, {}).items(),
                                         strict=False):
            ax.plot([n for n, _ in points], [t * 1e3 for _, t in points], style, color="grey",
                    label=f"stage 3 comm.: {term} term")
        if measured and i == 0:
            for stage, points in sorted(measured.items()):
                ax.plot([n for n, _ in points], [t * 1e3 for _, t in points], "o",
                        color=STAGE_COLORS[stage])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # a few ms to seconds: the measured dots stay readable
        # ticks at 1, 2, 5 x 10^k, written 20 or 0.5: a panel spanning less than a decade
        # still gets labels, and none reads 6x10^1
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_title(link, fontsize=10)
        ax.set_xlabel("world size N")
        ax.set_ylabel("ms per step" + (" (dots: measured here)" if measured and i == 0 else ""))
        ax.grid(True, which="both", alpha=0.25)
    for ax in list(axes.flat)[len(curves):]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=8)
    for ax in list(axes.flat)[1:len(curves)]:
        if any(line.get_color() == "grey" for line in ax.get_lines()):
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def activations_vs_states_figure(rows: list[dict], activations: dict[str, int], formula,
                                 title: str, unit=2**20, unit_name="MiB"):
    """Model states one rank holds against N per stage: `formula(stage, n)` as a line at
    every power of two up to the largest measured N, the measured rows as dots. Each entry of
    `activations` ({label: bytes}, which no stage divides) is a horizontal line: where it
    lies above a stage's curve, activations dominate that rank's memory."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.6))
    largest = max(r["world_size"] for r in rows)
    worlds = [2**k for k in range(largest.bit_length()) if 2**k <= largest]
    for stage in sorted({r["stage"] for r in rows} - {0}):
        mine = [r for r in rows if r["stage"] == stage]
        ax.plot(worlds, [formula(stage, n) / unit for n in worlds], "-",
                color=STAGE_COLORS[stage], alpha=0.6)
        ax.plot([r["world_size"] for r in mine], [r["held"]["total"] / unit for r in mine],
                "o", color=STAGE_COLORS[stage], label=f"model states, stage {stage}")
    styles = ["--", ":", "-.", (0, (6, 2, 1, 2, 1, 2))]
    for i, (label, nbytes) in enumerate(activations.items()):
        ax.axhline(nbytes / unit, color="black", linestyle=styles[i % len(styles)],
                   linewidth=1.2, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size N (dots: measured, lines: formula)")
    ax.set_ylabel(f"{unit_name} per rank")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(True, which="both", alpha=0.25)
    fig.tight_layout()
    return fig
