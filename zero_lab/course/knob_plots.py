"""Figures of notebook 08, one per knob where a picture says more than the table beside it.
Parent side; each takes the numbers a launch reported (or the formulas) and returns a figure.

    accumulation_figure   bytes per optimizer step against k (formula lines, measured dots;
                          ours and torch's FSDP2), what each configuration holds between
                          micro-batches
    hsdp_figure           bytes a step sends per level here (flat stage 3 vs HSDP), and the
                          bytes that cross the network per GPU on a cluster, projected
    recompute_figure      each stage's peak with recompute off and on, and the budgets in
                          which recompute decides between stage 1 and stage 3
"""

from __future__ import annotations

import itertools

from zero_lab.predict.knobs import accumulation_volume, fsdp2_accumulation_messages

KiB = 2**10
# one colour and line style per distinct formula line of the accumulation figure
LINE_STYLES = [("#4C72B0", "-"), ("#DD8452", "--"), ("#55A868", "-."), ("#C44E52", ":"),
               ("#8172B3", (0, (5, 1, 1, 1))), ("#937860", (0, (1, 1)))]


def _formula_in_psi(run: dict, k: int, world_size: int) -> float:
    """The volume per optimizer step, in Ψ, of `run`'s configuration at k micro-batches."""
    if "stage" not in run:  # one of torch's FSDP2 runs
        messages = fsdp2_accumulation_messages(
            1, k, world_size, reshard_after_forward=run["reshard_after_forward"],
            reshard_after_backward=run["reshard_after_backward"])
        return sum(m["volume"] for m in messages.values())
    return accumulation_volume(run["stage"], k, grad_accumulation=run["grad_accumulation"],
                               reshard_after_forward=run["reshard_after_forward"])


def accumulation_figure(report: dict):
    """Left: the paper's volume per optimizer step, in Ψ, against k. Configurations whose
    formulas agree at every k share one line, named after all of them (drawn one per
    configuration they would hide each other); the ledger's measurements are dots, ours
    filled, FSDP2's hollow, side by side around each k so that none hides another. Right:
    the gradients and parameters a rank holds between two micro-batches at the largest k."""
    import matplotlib.pyplot as plt

    runs = report["runs"] + report.get("fsdp2", [])
    labels = list(dict.fromkeys(r["label"] for r in runs))
    ks = sorted({r["k"] for r in runs})
    by_label = {label: sorted((r for r in runs if r["label"] == label), key=lambda r: r["k"])
                for label in labels}
    lines: dict[tuple[float, ...], list[str]] = {}  # formula at every k -> its configurations
    for label, mine in by_label.items():
        lines.setdefault(tuple(_formula_in_psi(mine[0], k, report["world_size"]) for k in ks),
                         []).append(label)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.2),
                                      gridspec_kw={"width_ratios": [1.25, 1]})
    dots = []  # (k, measured Ψ, label, colour): one per configuration and k
    for (values, names), (color, style) in zip(sorted(lines.items(), reverse=True),
                                               itertools.cycle(LINE_STYLES)):
        label = f"{values[-1]:g}Ψ at k = {ks[-1]}: " + ", ".join(names)
        left.plot(ks, values, linestyle=style, color=color, lw=1.5,
                  label="\n".join(_wrap(label, 62)))
        dots += [(r["k"], sum(s["volume"] for s in r["comm"].values()) / r["psi_bytes"], name,
                  color) for name in names for r in by_label[name]]
    for (k, value), same in _groups(dots).items():  # equal dots side by side around k
        for i, (_, _, name, color) in enumerate(same):
            fsdp2 = "stage" not in by_label[name][0]
            left.plot([k + (i - (len(same) - 1) / 2) * 0.15], [value], linestyle="none",
                      marker="s" if fsdp2 else "o", markersize=5, color=color,
                      markerfacecolor="white" if fsdp2 else color)
    left.plot([], [], "o", color="grey", label="measured, ours (one dot per configuration)")
    left.plot([], [], "s", color="grey", markerfacecolor="white", label="measured, FSDP2")
    left.set_xlabel("micro-batches per optimizer step, k")
    left.set_ylabel("volume per optimizer step (Ψ)")
    left.set_ylim(bottom=0)
    left.set_xticks(ks)
    left.set_title("bytes per optimizer step: formula (lines), ledger (dots)")
    left.legend(fontsize=6.5, loc="upper left")
    left.grid(True, alpha=0.25)

    top = [r for r in report["runs"] if r["k"] == max(ks)]
    names = [r["label"].replace(", ", "\n") for r in top]
    grads = [r["held_between"]["grads"] / KiB for r in top]
    params = [r["held_between"]["params"] / KiB for r in top]
    right.barh(names, grads, color="#DD8452", label="gradients")
    right.barh(names, params, left=grads, color="#4C72B0", label="parameters")
    right.invert_yaxis()
    right.tick_params(axis="y", labelsize=7)
    right.set_xlabel("KiB held between micro-batches, rank 0")
    right.set_title(f"what accumulation keeps (k = {max(ks)}), ours")
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _groups(dots: list[tuple]) -> dict[tuple, list[tuple]]:
    """The dots grouped by their (k, value), which would draw them on top of each other."""
    out: dict[tuple, list[tuple]] = {}
    for dot in dots:
        out.setdefault(dot[:2], []).append(dot)
    return out


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width, subsequent_indent="  ")


def hsdp_figure(here: dict, projected: dict[str, dict[str, float]], mesh: tuple[int, int]):
    """Left: what one rank's step sent here (`here` = check_knob_hsdp's summary), by level
    and op, flat stage 3 against HSDP. Right: `projected` {model: {"flat", "hsdp"}} bytes
    that cross the network per GPU per step on a cluster (projection.project_step)."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    parts = [("inside: all-gather", "#4C72B0"), ("inside: reduce-scatter", "#55A868"),
             ("across: all-reduce", "#C44E52")]
    flat, inside, across = here["flat"], here["inside"], here["across"]
    stacks = {
        "flat stage 3\n(one group of N)": [flat["all_gather"], flat["reduce_scatter"], 0],
        f"HSDP {mesh[0]} x {mesh[1]}": [inside["all_gather"], inside["reduce_scatter"],
                                        across["all_reduce"]],
    }
    for i, (name, color) in enumerate(parts):
        bottoms = [sum(v[:i]) / KiB for v in stacks.values()]
        left.bar(list(stacks), [v[i] / KiB for v in stacks.values()], bottom=bottoms,
                 color=color, label=name)
    left.set_ylabel("KiB per step, one rank (full messages)")
    left.set_title("measured here: the same bytes inside, plus Ψ/S across")
    left.legend(fontsize=7)

    models = list(projected)
    width = 0.38
    xs = range(len(models))
    right.bar([x - width / 2 for x in xs], [projected[m]["flat"] / 1e9 for m in models],
              width, color="#8C8C8C", label="flat stage 3")
    right.bar([x + width / 2 for x in xs], [projected[m]["hsdp"] / 1e9 for m in models],
              width, color="#C44E52", label="HSDP (nodes x GPUs per node)")
    right.set_xticks(list(xs), models)
    right.set_ylabel("GB over the network, per GPU per step")
    right.set_title("projected: 64 GPUs, DGX H100 nodes")
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig


def recompute_figure(peaks: dict[tuple[int, bool], int], budgets: tuple[int, int] | None,
                     unit=2**20, unit_name="MiB"):
    """Each stage's measured peak with recompute off and on; the band marks the budgets in
    which stage 1 fits only with recompute while stage 3 fits without it."""
    import matplotlib.pyplot as plt

    stages = sorted({s for s, _ in peaks})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    ax.bar([s - width / 2 for s in stages], [peaks[s, False] / unit for s in stages], width,
           color="#4C72B0", label="recompute off")
    ax.bar([s + width / 2 for s in stages], [peaks[s, True] / unit for s in stages], width,
           color="#DD8452", label="recompute on")
    if budgets:
        ax.axhspan(budgets[0] / unit, budgets[1] / unit, color="#55A868", alpha=0.2,
                   label="budgets: stage 1 needs recompute, stage 3 does not")
    ax.set_xticks(stages, [f"stage {s}" for s in stages])
    ax.set_ylabel(f"peak of a step, {unit_name} (rank 0)")
    ax.set_title("recompute lowers every stage's peak; stage 3 may not need it")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig
