"""Figures of profiler traces (notebook 06): a hand-made example of the time categories, a
timeline of one step per system and rank, the time categories per system, and memory over
the step. Parent side: reads trace files
through `zero_lab.profiling`, draws with matplotlib; `zero_lab.course.plots.save_figure` saves."""

from __future__ import annotations

from zero_lab.profiling.analysis import CATEGORIES, categorize, collective_spans
from zero_lab.profiling.trace import Trace

CATEGORY_COLORS = {"compute": "#4C72B0", "optimizer": "#55A868", "exposed_comm": "#C44E52",
                   "idle": "#DDDDDD", "overlapped_comm": "#E8A33D"}
CATEGORY_LABELS = {"compute": "compute (forward, backward)", "optimizer": "optimizer",
                   "exposed_comm": "exposed communication", "idle": "idle / framework",
                   "overlapped_comm": "communication hidden under compute"}
OP_COLORS = {"all_gather": "#8172B3", "reduce_scatter": "#DA8BC3", "all_reduce": "#937860",
             "broadcast": "#CCB974", "send": "#64B5CD", "recv": "#64B5CD", "other": "#999999"}
_SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}


def step_timeline_figure(traces: dict[str, list[Trace]], step: int | str = "fastest",
                         title: str | None = None):
    """One step per system (rows) and rank: the training thread's time by category (top
    lane) and every collective from issue to completion, coloured by op and labelled with
    its unit or bucket (bottom lane). Times from the step's start, in ms; one shared axis.
    `step`: an index into each trace's steps, or "fastest" (each rank's shortest)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    def window(trace: Trace) -> tuple[float, float]:
        if step == "fastest":
            return min(trace.steps, key=lambda w: w[1] - w[0])
        return trace.steps[step]

    rows = [(system, t) for system, ts in traces.items() for t in ts]
    longest = max(window(t)[1] - window(t)[0] for _, t in rows) / 1e3
    fig, ax = plt.subplots(figsize=(13, 0.62 * len(rows) + 1.6))
    ticks, labels = [], []
    for i, (system, trace) in enumerate(rows):
        y = len(rows) - 1 - i
        lo, hi = window(trace)
        for name, spans in categorize(trace.events, (lo, hi)).items():
            if name == "overlapped_comm":
                continue
            ax.broken_barh([((s - lo) / 1e3, (e - s) / 1e3) for s, e in spans], (y + 0.38, 0.5),
                           color=CATEGORY_COLORS[name], linewidth=0)
        for op, label, s, e in collective_spans(trace, (lo, hi)):
            # reduce-scatters on a sub-lane of their own: they overlap the next all-gathers
            base = y + (0.02 if op == "reduce_scatter" else 0.18)
            x, w = (s - lo) / 1e3, max((e - s) / 1e3, longest / 800)
            ax.broken_barh([(x, w)], (base, 0.15), color=OP_COLORS.get(op, "#999999"),
                           alpha=0.85, linewidth=0.3, edgecolor="white")
            tag = label.replace("unit ", "u").replace("bucket ", "b")
            if w > longest / 40 and tag:
                ax.text(x + w / 2, base + 0.075, f"{_SHORT.get(op, op)} {tag}", ha="center",
                        va="center", fontsize=5.5, color="black", clip_on=True)
        ticks.append(y + 0.45)
        labels.append(f"{system}  r{trace.rank}")
        if i and rows[i - 1][0] != system:
            ax.axhline(y + 1 - 0.05, color="black", linewidth=0.6)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlim(0, longest)
    ax.set_ylim(-0.1, len(rows))
    ax.set_xlabel("time since the step began (ms)")
    legend = [Patch(color=CATEGORY_COLORS[c], label=CATEGORY_LABELS[c]) for c in CATEGORIES]
    legend += [Patch(color=OP_COLORS[op], label=f"{_SHORT[op]} = {op.replace('_', '-')} "
                     "(issue -> done)") for op in _SHORT]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.04 - 0.5 / len(rows)),
              ncol=4, fontsize=8, frameon=False)
    ax.set_title(title or f"One training step per system and rank ({step} step)")
    fig.tight_layout()
    return fig


def time_categories_figure(breakdowns: dict[str, dict], title: str | None = None):
    """Stacked horizontal bars per system: compute, optimizer, exposed communication and idle
    (they sum to the step), with the communication hidden under compute as a thin bar."""
    import matplotlib.pyplot as plt

    systems = list(breakdowns)
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(systems) + 1.5))
    for i, system in enumerate(systems):
        b, left, y = breakdowns[system], 0.0, len(systems) - 1 - i
        for name in CATEGORIES:
            width = b[name] / 1e3
            ax.barh(y, width, left=left, color=CATEGORY_COLORS[name], height=0.6,
                    label=CATEGORY_LABELS[name] if i == 0 else None)
            if width > b["step"] / 1e3 * 0.07:
                ax.text(left + width / 2, y, f"{width:.1f}", ha="center", va="center",
                        fontsize=7, color="white" if name != "idle" else "black")
            left += width
        ax.barh(y - 0.38, b["overlapped_comm"] / 1e3, color=CATEGORY_COLORS["overlapped_comm"],
                height=0.12, label=CATEGORY_LABELS["overlapped_comm"] if i == 0 else None)
        ax.text(left + 0.5, y, f"{b['step'] / 1e3:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(systems))[::-1], systems, fontsize=9)
    ax.set_xlabel("ms per step (one recorded step per rank, averaged over ranks)")
    ax.set_xlim(0, max(b["step"] for b in breakdowns.values()) / 1e3 * 1.15)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(systems)), ncol=3,
              fontsize=8, frameon=False)
    ax.set_title(title or "Where a step's time goes")
    fig.tight_layout()
    return fig


def memory_over_step_figure(curves: dict[str, list[tuple[float, int]]], unit=2**20,
                            unit_name="MiB", title: str | None = None):
    """Bytes this rank holds over one step, per system (one panel each, one shared scale):
    absolute curves (`zero_lab.profiling.checks.absolute_curve`: the model states held when
    the step began plus what was allocated since), with the step's starting level dashed, so
    that what a system keeps between steps shows as well as what it allocates in one."""
    import matplotlib.pyplot as plt

    cols = 3
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(12, 2.5 * rows), squeeze=False,
                             sharey=True)
    for ax, (system, curve) in zip(axes.flat, curves.items(), strict=False):
        t = [x / 1e3 for x, _ in curve]
        b = [y / unit for _, y in curve]
        ax.step(t, b, where="post", color="#4C72B0", linewidth=1)
        ax.fill_between(t, b, step="post", alpha=0.25, color="#4C72B0")
        ax.axhline(b[0], color="black", linestyle="--", linewidth=0.8)
        ax.annotate(f"start {b[0]:.0f}", (t[-1], b[0]), xytext=(0, -9),
                    textcoords="offset points", ha="right", fontsize=7)
        ax.set_title(f"{system}: peak {max(b):.0f} {unit_name}", fontsize=9)
        ax.set_xlabel("ms since the step began", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel(f"{unit_name} held", fontsize=8)
    for ax in list(axes.flat)[len(curves):]:
        ax.set_visible(False)
    fig.suptitle(title or "Memory over one step: model states held at the start (dashed) plus "
                 "what the step allocates (rank 0)")
    fig.tight_layout()
    return fig


def example_timeline_figure(events, window: tuple[float, float], title: str | None = None):
    """A handful of hand-made events on two lanes (the training thread; a collective in
    flight on gloo's thread) above the categories the analysis gives them: what "exposed"
    and "hidden" mean before any formula."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lo, hi = window
    fig, ax = plt.subplots(figsize=(10, 3.2))
    lanes = {"main": 2.2, "other": 1.3}
    for e in events:
        if e.kind == "mark":
            continue
        y = lanes["main" if e.track == "main" else "other"]
        nested = any(o is not e and o.track == e.track and o.start <= e.start and e.end <= o.end
                     for o in events)
        color = {"compute": "#4C72B0", "comm": "#C44E52", "in_flight": OP_COLORS["all_reduce"],
                 "optimizer": CATEGORY_COLORS["optimizer"]}[e.kind]
        height = 0.3 if e.kind == "optimizer" else 0.5
        ax.broken_barh([(e.start - lo, e.duration)], (y - height / 2, height), color=color,
                       alpha=0.5 if e.kind == "optimizer" else 0.9)
        if not nested:  # (an op inside the optimizer region is named by the region)
            ax.text(e.start - lo + e.duration / 2, y + 0.34, e.name, ha="center", fontsize=7)
    for name, spans in categorize(events, window).items():
        y = 0.5 if name == "overlapped_comm" else 0
        ax.broken_barh([(s - lo, e - s) for s, e in spans], (y - 0.15, 0.3),
                       color=CATEGORY_COLORS[name])
    ax.set_yticks([0, 0.5, 1.3, 2.2], ["categories", "hidden comm", "gloo thread",
                                   "training thread"], fontsize=8)
    ax.set_xlim(0, hi - lo)
    ax.set_ylim(-0.4, 2.9)
    ax.set_xlabel("time in the step (us)")
    ax.legend(handles=[Patch(color=CATEGORY_COLORS[c], label=CATEGORY_LABELS[c])
                       for c in (*CATEGORIES, "overlapped_comm")],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, fontsize=8, frameon=False)
    ax.set_title(title or "Five events, and the categories the analysis gives them")
    fig.tight_layout()
    return fig
