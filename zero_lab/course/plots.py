"""Matplotlib figures for the notebooks, and the one place figures are saved.

Notebooks call `save_figure(fig, "name")`; the file lands in `runs/figures/` (or the folder
named by $ZERO_LAB_FIGURES_DIR) and `make figures` copies it into the committed `figures/`.
Widgets show a figure as `png_bytes(fig)` in an ipywidgets Image.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from zero_lab.course.formatting import readable_number
from zero_lab.launch.paths import figures_dir


def save_figure(fig, name: str) -> Path:
    """Save `fig` as <figures_dir>/<name>.png (150 dpi, tight) and return the path.

    Written whole or not at all: to a temporary name beside it (this process's), renamed
    over the figure's name once complete; a write that fails (a full disk) removes it and
    says which figure, where, and what to do."""
    if not name or "/" in name or name.endswith(".png"):
        raise ValueError(f"name must be a bare file stem like 'memory_per_stage', got {name!r}")
    path = figures_dir() / f"{name}.png"
    partial = path.with_name(f".{name}.partial-{os.getpid()}.png")
    try:
        fig.savefig(partial, dpi=150, bbox_inches="tight")
        os.replace(partial, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise OSError(err.errno, f"{err.strerror}: saving figure {name!r}; free space, or set "
                                 "ZERO_LAB_FIGURES_DIR to a writable folder", str(path)) from err
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    return path


def png_bytes(fig, dpi: int = 100) -> bytes:
    """`fig` as PNG bytes, the figure closed (an Image widget's value, redrawn whole)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()


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
    from `zero_lab.memory.model_state_bytes`; a dashed line marks `gpu_bytes` if given. The
    legend sits outside the axes, where it covers no bar or total. Returns the figure.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(7.4, 3.6))
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
        ax.annotate(readable_number(top), (x, top), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points",  # readable over the GPU line:
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    if gpu_bytes is not None:
        ax.axhline(gpu_bytes / unit, color="black", linestyle="--", linewidth=1,
                   label=f"GPU: {gpu_bytes / unit:g} {unit_name}")
    ax.set_ylim(0, max(bottoms + [(gpu_bytes or 0) / unit]) * 1.15 or 1)  # room for totals
    ax.set_ylabel(f"{unit_name} per rank")
    if title:
        ax.set_title(title, fontsize=10)
    handles, names = ax.get_legend_handles_labels()
    bars = [i for i, name in enumerate(names) if not name.startswith("GPU")][::-1]  # top first
    order = bars + [i for i in range(len(names)) if i not in bars]  # then the GPU line
    ax.legend([handles[i] for i in order], [names[i] for i in order], fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def activation_curves(n_layers: int, hidden: int, heads: int, seq_lens, micro_batch: int = 1,
                      attention: str = "fused") -> dict[str, list[int]]:
    """Activation bytes per rank at each sequence length, one list per checkpointing mode.

    One attention kind for every mode (`memory.ATTENTION`): mixing them (the paper's unfused
    count for "full", a fused kernel for "selective") would draw full recompute above
    selective at long sequences, where it is the cheaper of the two."""
    from zero_lab import memory

    return {mode: [memory.activation_bytes(n_layers, s, micro_batch, hidden, heads, mode,
                                           attention=attention) for s in seq_lens]
            for mode in memory.CHECKPOINTING}


def activations_vs_states_figure(seq_lens, curves, states_bytes, attention, title,
                                 unit=2**30, unit_name="GiB"):
    """Notebook 01: `activation_curves` per checkpointing mode against the sharded model
    states (dotted), log-log; the attention kind is named in the title."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    styles = {"selective": ("--", "x")}  # dashed, crosses: visible where it lies on "none"
    for mode, values in curves.items():
        ls, marker = styles.get(mode, ("-", "o"))
        ax.plot(seq_lens, [v / unit for v in values], marker=marker, ls=ls,
                label=f"activations, {mode}")
    ax.axhline(states_bytes / unit, color="black", linestyle=":",
               label="model states, stage 3, N_d = 8")
    ax.set(xscale="log", yscale="log", xlabel="sequence length",
           ylabel=f"{unit_name} per rank", title=f"{title}, {attention} attention")
    ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---- notebook 02: collectives ------------------------------------------------------

OP_COLORS = {"all_reduce": "#4C72B0", "reduce_scatter": "#DD8452", "all_gather": "#55A868",
             "broadcast": "#8172B3"}


def scheduled_ring_states(world_size: int):
    """What `ring_schedule` says a ring all-reduce does, in `recorded_ring_states`' form: the
    notebook checks the run against it."""
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


def recorded_ring_states(ranks: list[dict]):
    """Yield (title, state, received) for the start and every step of the ring all-reduce the
    ranks recorded (collectives_demo.py's `ring_steps`: rank r started with 2^r in every chunk).

    state[r][c] is the set of ranks whose data chunk c on rank r holds, read off the bits of
    its value; `received` the (rank, chunk) cells that changed in that step.
    """
    n = len(ranks)
    records = [rank["ring_steps"] for rank in ranks]
    previous = None
    for i, first in enumerate(records[0]):
        state = [[{b for b in range(n) if int(records[r][i]["chunks"][c]) >> b & 1}
                  for c in range(n)] for r in range(n)]
        received = set() if previous is None else {
            (r, c) for r in range(n) for c in range(n) if state[r][c] != previous[r][c]}
        title = ("start: rank r holds its own tensor" if first["phase"] == "start"
                 else f"{first['phase']} step {first['step']}")
        yield title, state, received
        previous = state


def ring_steps_figure(ranks: list[dict]):
    """Grid per step of the ring all-reduce the ranks ran (their reports' `ring_steps`): rows
    are ranks, columns chunks, each cell says whose contributions it holds; red outlines mark
    what each rank received in that step."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n = len(ranks)
    panels = list(recorded_ring_states(ranks))
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


# ---- the benchmark (python -m zero_lab.course.bench) ---------------------------------------


def bench_figure(result: dict):
    """Three panels per system: step time (best round as a bar, every round's median as a
    dot, on a CPU the floor its CPU work sets as a line), bytes held by rank 0 per category,
    and bytes one step sends by collective."""
    import matplotlib.pyplot as plt

    systems = result["systems"]
    labels = [s.get("short") or s["label"] for s in systems.values()]
    x = range(len(systems))
    fig, (ax_t, ax_m, ax_c) = plt.subplots(1, 3, figsize=(max(15.0, 1.5 * len(systems)), 5.2))

    best = [s["best_round_ms"] for s in systems.values()]
    ax_t.bar(x, best, color="#BBBBBB", label="best round (median of its steps)")
    for i, s in enumerate(systems.values()):
        ax_t.plot([i] * len(s["round_medians_ms"]), s["round_medians_ms"], "o", color="black",
                  markersize=3, label="each round" if i == 0 else None)
        ax_t.annotate(f"{best[i]:.0f}", (i, 0), ha="center", va="bottom", fontsize=8,
                      xytext=(0, 3), textcoords="offset points")  # inside, clear of the dots
        if "cpu_floor_ms" in s:  # on a CPU: the shortest step its CPU work allows
            ax_t.plot([i - 0.4, i + 0.4], [s["cpu_floor_ms"]] * 2, color="#CC3311", lw=2,
                      label="CPU floor (work / cores)" if i == 0 else None)
    ax_t.set_ylabel("ms per step (slowest rank)")
    ax_t.set_title("step time", fontsize=10)
    ax_t.legend(fontsize=7.5, loc="best")

    rows = [{"label": label, "stage": None, **s["held_bytes"][0]}
            for label, s in zip(labels, systems.values(), strict=True)]
    memory_stage_bars(rows, ax=ax_m, unit=2**20, unit_name="MiB",
                      title="held after backward, rank 0 (params / grads / optimizer)")

    bottoms = [0.0] * len(systems)
    ops = [op for op in OP_COLORS if any(op in s["comm"][0]["by_op"] for s in systems.values())]
    for op in ops:
        values = [s["comm"][0]["by_op"].get(op, {}).get("sent_bytes", 0) / 2**20
                  for s in systems.values()]
        ax_c.bar(x, values, bottom=bottoms, color=OP_COLORS[op], label=op)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for i, top in enumerate(bottoms):
        ax_c.annotate(f"{top:.1f}", (i, top), ha="center", va="bottom", fontsize=8)
    ax_c.set_ylabel("MiB sent by rank 0 per step (ring)")
    ax_c.set_title("communication per step", fontsize=10)
    ax_c.legend(fontsize=7.5)
    one_line = [label.replace("\n", " ") for label in labels]
    for ax in (ax_t, ax_m, ax_c):
        ax.set_xticks(list(x), one_line, fontsize=7.5, rotation=40, ha="right",
                      rotation_mode="anchor")
    cfg = result["config"]
    fig.suptitle(f"{cfg['depth']} x Linear({cfg['width']}) + ReLU, Adam, {cfg['batch']} rows "
                 f"per rank, N = {result['world_size']} ({result['backend']}, "
                 f"{result['device']})", fontsize=11)
    fig.tight_layout()
    return fig


# ---- notebooks 03 and 04: ZeRO stages 1 and 2 ----------------------------------------


def _held_range(state: str, stage: int, rank: int, shard: int, padded: int) -> tuple[int, int]:
    """[start, end) of the flat buffer whose `state` rank `rank` keeps at ZeRO `stage`."""
    sharded_from = {"optimizer": 1, "grads": 2, "params": 3}[state]
    return (rank * shard, (rank + 1) * shard) if stage >= sharded_from else (0, padded)


def ownership_figure(sizes, names, world_size: int, stage: int, title: str | None = None):
    """Who owns what in one flat buffer: the parameters laid end to end (padding hatched),
    the slice boundaries, and, per rank, which part of each state it keeps at `stage`."""
    import matplotlib.pyplot as plt

    n = world_size
    total = sum(sizes)
    shard = -(-total // n)
    padded = shard * n
    states = ("params", "grads", "optimizer")
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.95 * n))  # rows tall enough for 9 pt labels
    y = 0.0
    offset = 0
    for i, (size, name) in enumerate(zip(sizes, names, strict=True)):
        ax.broken_barh([(offset, size)], (y, 0.8), facecolor="#D9D9D9" if i % 2 else "#A6A6A6",
                       edgecolor="white")
        if size > padded * 0.06:
            ax.text(offset + size / 2, y + 0.4, name, ha="center", va="center", fontsize=8.5)
        offset += size
    if padded > total:
        ax.broken_barh([(total, padded - total)], (y, 0.8), facecolor="white",
                       edgecolor="black", hatch="///")
    labels = [(y + 0.4, "flat buffer")]
    for r in range(n):
        for k, state in enumerate(states):
            y = -(r * (len(states) + 1) + k + 1.3) * 0.5
            lo, hi = _held_range(state, stage, r, shard, padded)
            ax.broken_barh([(lo, hi - lo)], (y, 0.4), facecolor=STATE_COLORS[state])
            labels.append((y + 0.2, f"rank {r} {state}"))
    for r in range(n + 1):
        ax.axvline(r * shard, color="black", linestyle="--", linewidth=0.8)
    for r in range(n):
        ax.text((r + 0.5) * shard, 1.05, f"rank {r} owns [{r * shard:,}, {(r + 1) * shard:,})",
                ha="center", va="bottom", fontsize=8)
    ax.set_yticks([p for p, _ in labels], [t for _, t in labels], fontsize=9)
    ax.set_xlim(0, padded)
    ax.set_xlabel(f"element of the flat buffer (Ψ = {total:,}, padded to N·S = {padded:,})")
    ax.set_title(title or f"ZeRO stage {stage}, N = {n}: what each rank keeps", fontsize=10,
                 pad=18)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def predicted_vs_measured_bars(rows, unit=2**20, unit_name="MiB", title=None):
    """Grouped bars: per row (e.g. "stage 1, rank 0") and per category, the predicted bytes
    (hatched) beside the measured bytes (solid). Each row: {"label", "predicted",
    "measured"}, the last two dicts with "params", "grads", "optimizer"."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    states = ("params", "grads", "optimizer")
    width = 0.13
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows)), 3.8))
    for i, row in enumerate(rows):
        for k, state in enumerate(states):
            x = i + (k - 1) * 2.2 * width
            pred, meas = row["predicted"][state] / unit, row["measured"][state] / unit
            ax.bar(x - width / 2, pred, width, facecolor="white", edgecolor=STATE_COLORS[state],
                   hatch="////")
            ax.bar(x + width / 2, meas, width, color=STATE_COLORS[state])
    ax.set_xticks(range(len(rows)), [row["label"] for row in rows], fontsize=8)
    ax.set_ylabel(f"{unit_name} per rank")
    handles = [Patch(color=STATE_COLORS[s], label=s) for s in states] + [
        Patch(facecolor="white", edgecolor="black", hatch="////", label="predicted"),
        Patch(color="black", label="measured")]
    ax.legend(handles=handles, fontsize=7.5, ncol=5, loc="upper right")
    ax.set_title(title or "model-state bytes per rank: predicted (memory.model_state_bytes) "
                          "vs measured", fontsize=10)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    fig.tight_layout()
    return fig


def peak_vs_held_figure(sweep, references, unit=2**20, unit_name="MiB", title=None):
    """Stage 2's peak and held bytes against bucket size (`sweep`: dicts with "bucket_mb",
    "peak", "held"), with other runs' peaks as horizontal lines (`references`: label ->
    bytes), named in a legend outside the axes: they lie too close together for labels."""
    import matplotlib.pyplot as plt

    sweep = sorted(sweep, key=lambda p: p["bucket_mb"])
    x = [p["bucket_mb"] for p in sweep]
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    ax.plot(x, [p["peak"] / unit for p in sweep], "o-", color="#C44E52",
            label="stage 2: peak during the step")
    ax.plot(x, [p["held"] / unit for p in sweep], "s--", color="#4C72B0",
            label="stage 2: held after backward")
    styles = ["-.", ":", "--", "-"]
    for (label, value), style in zip(references.items(), styles * 3, strict=False):
        ax.axhline(value / unit, color="black", linestyle=style, linewidth=1, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{b:g}" for b in x])
    ax.set_xlabel("bucket size (MB)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
    ax.set_ylabel(f"{unit_name}, rank 0")
    ax.set_title(title or "peak vs held memory across bucket sizes", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


# ---- notebook 05: ZeRO stage 3 ------------------------------------------------------


def lifecycle_timeline_figure(runs: dict, unit=2**10, unit_name="KiB", title=None,
                              above_start=False):
    """Bytes alive after every op of one training step: one panel per run.

    `runs` maps a panel title to a report of `zero_lab.workers.zero3_lifecycle.measure_step`
    ("samples", "marks", "held", "start_bytes", and for stage 3 "units"). Every panel shares
    one y-axis from 0, so stage 3's level reads against stage 0's (compare with the dashed
    line, the model states). The backward pass is shaded; where a stage-3 run gathers a unit,
    a thin line marks it, named on the first panel u0, u1, ...: units counted in forward order.

    `above_start=True` draws instead the bytes each step adds above the level it started from
    (named in the panel's title), each panel on its own y-axis from 0: on one axis from 0 a
    small model's unit is a few percent of stage 0's level and the sawtooth too faint to see;
    above the start, one tooth is a large share of its panel.
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.4 * len(runs)), squeeze=False,
                             sharey=not above_start)
    named, n_units = False, 0
    for ax, (label, run) in zip(axes[:, 0], runs.items(), strict=True):
        base = run["start_bytes"] if above_start else 0
        samples = [(b - base) / unit for b in run["samples"]]
        marks = {text: i for i, text in run["marks"]}
        if "forward done" in marks and "backward done" in marks:
            ax.axvspan(marks["forward done"], marks["backward done"], color="#EEEEEE",
                       label="backward")
        order = [u["unit"] for u in run.get("units", [])]  # module names, in forward order
        gathers = [(i, text.split()[-1]) for i, text in run["marks"] if " gather " in text]
        n_units = max(n_units, len(order))
        for i, name in gathers:
            ax.axvline(i, color=STATE_COLORS["params"], lw=0.6, alpha=0.5)
            if not named:  # above the panel, where no curve or legend covers it
                k = order.index(name) if name in order else name
                ax.annotate(f"u{k}", (i, 1.0), xycoords=("data", "axes fraction"),
                            xytext=(0, 2), textcoords="offset points", fontsize=7.5,
                            ha="center", va="bottom", color=STATE_COLORS["params"])
        named = named or bool(gathers)
        ax.plot(range(len(samples)), samples, color="#333333", lw=1.2, label="alive")
        held = "held after backward" if above_start else "model states held after backward"
        ax.axhline((run["held"]["total"] - base) / unit, ls="--",
                   color=STATE_COLORS["optimizer"], lw=1, label=held)
        if above_start:
            label = f"{label} (starts at {base / unit:,.0f} {unit_name})"
            ax.set_ylim(bottom=min(0, *samples))  # each panel its own scale, from its start
        ax.set_title(label, fontsize=10, loc="left", pad=12)
        ax.set_ylabel(f"{unit_name} above start" if above_start else f"{unit_name} alive")
        ax.set_xlim(0, len(samples) - 1)
    if not above_start:
        axes[0, 0].set_ylim(bottom=0)  # shared: every panel from 0
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8,
               frameon=False)
    units = f"u0-u{n_units - 1}: units 0-{n_units - 1}" if n_units else "u<k>: unit k"
    axes[-1, 0].set_xlabel("ops of one training step (forward, backward, optimizer step); "
                           f"{units} (numbered in forward order) gathered")
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.03, 1, 1))  # leave the bottom strip to the legend
    return fig
