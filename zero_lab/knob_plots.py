"""Figures of notebook 08, one per knob where a picture says more than the table beside it.
Parent side; each takes the numbers a launch reported (or the formulas) and returns a figure.

    accumulation_figure   bytes per optimizer step against k (formula lines, measured dots),
                          and what each configuration holds between micro-batches
    hsdp_figure           bytes a step sends per level here (flat stage 3 vs HSDP), and the
                          bytes that cross the network per GPU on a cluster, projected
    recompute_figure      each stage's peak with recompute off and on, and the budgets in
                          which recompute decides between stage 1 and stage 3
"""

from __future__ import annotations

from zero_lab.knob_formulas import accumulation_volume

KiB = 2**10
# one colour per configuration of notebook 08's accumulation runs, stage by stage
RUN_COLORS = {
    "stage 0": "#4C72B0", "stage 1": "#DD8452", "stage 2 sharded": "#55A868",
    "stage 2 unsharded": "#8FBC8F", "stage 3 sharded, reshard": "#C44E52",
    "stage 3 unsharded, reshard": "#E08A8C", "stage 3 sharded, keep": "#8172B3",
    "stage 3 unsharded, keep": "#B3A7D6",
}


def accumulation_figure(report: dict):
    """Left: the paper's volume per optimizer step, in Ψ, against k: the formula as a line,
    the ledger's measurement as dots, per configuration. Right: the gradients and parameters
    a rank holds between two micro-batches at the largest k (KiB)."""
    import matplotlib.pyplot as plt

    runs = report["runs"]
    labels = list(dict.fromkeys(r["label"] for r in runs))
    ks = sorted({r["k"] for r in runs})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6),
                                      gridspec_kw={"width_ratios": [1.1, 1]})
    for label in labels:
        mine = sorted((r for r in runs if r["label"] == label), key=lambda r: r["k"])
        first = mine[0]
        options = {"grad_accumulation": first["grad_accumulation"],
                   "reshard_after_forward": first["reshard_after_forward"]}
        color = RUN_COLORS.get(label, "grey")
        left.plot(ks, [accumulation_volume(first["stage"], k, **options) for k in ks], "-",
                  color=color, alpha=0.7, label=label)
        left.plot([r["k"] for r in mine],
                  [sum(s["volume"] for s in r["comm"].values()) / r["psi_bytes"] for r in mine],
                  "o", color=color)
    left.set_xlabel("micro-batches per optimizer step, k")
    left.set_ylabel("volume per optimizer step (Ψ)")
    left.set_xticks(ks)
    left.set_title("bytes per optimizer step: formula (lines), ledger (dots)")
    left.legend(fontsize=7)
    left.grid(True, alpha=0.25)

    top = [r for r in runs if r["k"] == max(ks)]
    names = [r["label"].replace(", ", "\n") for r in top]
    grads = [r["held_between"]["grads"] / KiB for r in top]
    params = [r["held_between"]["params"] / KiB for r in top]
    right.barh(names, grads, color="#DD8452", label="gradients")
    right.barh(names, params, left=grads, color="#4C72B0", label="parameters")
    right.invert_yaxis()
    right.tick_params(axis="y", labelsize=7)
    right.set_xlabel("KiB held between micro-batches, rank 0")
    right.set_title(f"what accumulation keeps (k = {max(ks)})")
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig


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
