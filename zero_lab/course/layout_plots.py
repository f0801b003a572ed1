"""Where the shards lie, drawn from what the ranks of a launch reported.

- `hsdp_grid_figure(reports)` (notebook 08): the R x S ranks of hybrid sharding as a grid.
  Rank k sits in row k // S, column k % S (stages/hybrid.py's groups; torch's DeviceMesh
  lays its ranks out the same way). Each row is a shard group: its S ranks cut the
  parameters in S slices and send all-gathers and reduce-scatters among themselves; each
  column is a replicate group: the R ranks holding the same slice all-reduce its gradient.
  Every number is one rank's own report: its bytes held and sent at each level.
- `fsdp2_vs_flat_figure(reports, group)` (notebook 09): one FSDP2 group's parameters as each
  rank holds them, every parameter cut on dim 0 (its own padding), beside the course's flat
  buffer of the same parameters cut once (one padding at the end). The shapes are each
  rank's DTensors' local shapes, as the launch reported them.
"""

from __future__ import annotations

import math

RANK_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860",
                "#DA8BC3", "#8C8C8C")
KiB = 2**10


def _kib(nbytes: float) -> str:
    return f"{nbytes / KiB:,.1f} KiB"


def hsdp_grid_figure(reports: list[dict]):
    """The R x S grid of `knob_hsdp.py`'s ranks (every rank's report, in rank order)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    replicas, shards = reports[0]["mesh"]
    if len(reports) != replicas * shards:
        raise ValueError(f"{len(reports)} reports for a {replicas} x {shards} mesh")
    fig, ax = plt.subplots(figsize=(2.9 * shards + 2.6, 1.7 * replicas + 1.3))
    for k, rep in enumerate(reports):
        r, s = divmod(k, shards)
        hsdp = rep["hsdp"]
        ax.add_patch(FancyBboxPatch((s * 3 + 0.15, r * 2 + 0.2), 2.7, 1.5,
                                    boxstyle="round,pad=0.02", facecolor=RANK_COLOURS[
                                        s % len(RANK_COLOURS)], alpha=0.85, edgecolor="none"))
        ax.text(s * 3 + 1.5, r * 2 + 0.95,
                f"rank {k}\nslice {s + 1} of {shards}\nholds {_kib(hsdp['held_bytes'])}",
                ha="center", va="center", color="white", fontsize=9)
    for r in range(replicas):  # a row: one shard group
        sent = sum(reports[r * shards]["hsdp"]["by_level"]["shard"].values())
        ax.annotate("", xy=(shards * 3 - 0.1, r * 2 + 1.82), xytext=(0.1, r * 2 + 1.82),
                    arrowprops={"arrowstyle": "<->", "color": "#333333"})
        ax.text(shards * 3 + 0.2, r * 2 + 0.95,
                f"shard group {r}:\nall-gather +\nreduce-scatter,\n{_kib(sent)} a rank",
                va="center", fontsize=8)
    for s in range(shards):  # a column: one replicate group
        sent = sum(reports[s]["hsdp"]["by_level"]["replicate"].values())
        ax.annotate("", xy=(s * 3 + 0.05, replicas * 2 - 0.1), xytext=(s * 3 + 0.05, 0.1),
                    arrowprops={"arrowstyle": "<->", "color": "#C44E52"})
        ax.text(s * 3 + 1.5, replicas * 2 + 0.1,
                f"replicate group {s}: all-reduce\nof slice {s + 1}, {_kib(sent)} a rank",
                ha="center", va="top", fontsize=8, color="#C44E52")
    ax.set_xlim(-0.2, shards * 3 + 2.4)
    ax.set_ylim(replicas * 2 + 0.9, -0.1)
    ax.axis("off")
    ax.set_title(f"HSDP on {replicas} x {shards} = {replicas * shards} ranks: sharded along a "
                 "row, replicated down a column", fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def _rows_per_rank(rows: int, n: int) -> list[int]:
    """torch.chunk's cut of `rows` on N ranks: ceil(rows / N) each until they run out."""
    size = -(-rows // n)
    return [max(0, min(size, rows - r * size)) for r in range(n)]


def fsdp2_vs_flat_figure(reports: list[dict], group: str):
    """One FSDP2 group as every rank holds it, beside the flat buffer of the same parameters.

    `reports`: each rank's report of fsdp2_practice.py (its "wrap": parameters with their
    global and local shapes, groups with their parameter names), in rank order."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n = len(reports)
    groups = {g["module"]: g for g in reports[0]["wrap"]["groups"]}
    if group not in groups:
        raise ValueError(f"group {group!r} is not in the report: {sorted(groups)}")
    names = groups[group]["params"]
    shapes = [{p["name"]: p for p in rep["wrap"]["params"]} for rep in reports]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 3.6), sharex=True)
    x = 0
    for name in names:
        shape = shapes[0][name]["global"]
        per_row = math.prod(shape[1:])
        padded_rows = -(-shape[0] // n) * n
        held = [shapes[r][name]["local"][0] for r in range(n)]
        if held != _rows_per_rank(shape[0], n):  # the run, not the rule, is drawn
            raise ValueError(f"{name}: ranks hold {held} rows, not torch.chunk's cut")
        cut = -(-shape[0] // n)
        for r in range(n):
            start = x + r * cut * per_row
            top.add_patch(Rectangle((start, 0), held[r] * per_row, 1,
                                    facecolor=RANK_COLOURS[r % len(RANK_COLOURS)],
                                    edgecolor="white", linewidth=0.5))
            if held[r] < cut:  # this rank's padding rows
                top.add_patch(Rectangle((start + held[r] * per_row, 0),
                                        (cut - held[r]) * per_row, 1, facecolor="white",
                                        edgecolor="#999999", hatch="////", linewidth=0.5))
        label = name.removeprefix(f"{group}.") if group != "(root)" else name
        top.text(x + padded_rows * per_row / 2, 1.05 + 0.42 * (names.index(name) % 2),
                 f"{label} {'x'.join(map(str, shape))}", ha="center", va="bottom", fontsize=7)
        x += padded_rows * per_row
    fsdp2_total = x
    numel = sum(math.prod(shapes[0][name]["global"]) for name in names)
    slice_ = -(-numel // n)
    for r in range(n):
        real = max(0, min(slice_, numel - r * slice_))
        bottom.add_patch(Rectangle((r * slice_, 0), real, 1, edgecolor="white",
                                   facecolor=RANK_COLOURS[r % len(RANK_COLOURS)]))
        if real < slice_:
            bottom.add_patch(Rectangle((r * slice_ + real, 0), slice_ - real, 1,
                                       facecolor="white", edgecolor="#999999", hatch="////"))
        bottom.text(r * slice_ + slice_ / 2, 0.5, f"rank {r}", ha="center", va="center",
                    color="white", fontsize=9)
    for ax, label in ((top, f"FSDP2: each parameter cut on dim 0, {fsdp2_total:,} elements "
                            f"with padding"),
                      (bottom, f"flat buffer: the group cut once, {slice_ * n:,} elements "
                               f"with padding")):
        ax.set_xlim(0, max(fsdp2_total, slice_ * n))
        ax.set_ylim(0, 1.95)
        ax.set_yticks([])
        ax.set_title(label, fontsize=9, loc="left")
        for side in ax.spines.values():
            side.set_visible(False)
    bottom.set_xlabel(f"elements of group {group!r} on {n} ranks (colour: the rank that holds "
                      "them; hatched: padding)", fontsize=8)
    fig.tight_layout()
    return fig
