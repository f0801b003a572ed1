"""The decision guide as a figure, drawn from `projection.recommend` itself: for each model
size and GPU count the stage it chooses, one panel per accumulation count k (micro-batches
per optimizer step). Parent side; notebook 07 draws it and the cheat sheet links it.

The rows the notebook and the cheat sheet talk about are the course's at-scale models,
Llama 3.1 8B and Llama 3 70B (zero_lab/course/models.py), priced on their published shapes;
the sizes around them, a guide's axis for reading off another model, get `memory.gpt_shape`'s
GPT-3-like guess.

    shape, label        a row's (n_layers, hidden, heads) and its name ("Llama 3 70B", "13B")
    gpt_compute         one micro-batch's compute: 4 x 4,096 tokens, full recompute, 40% MFU
    gpt_activations     one micro-batch's activations, full checkpointing, fused attention
    gpt_recommendation  notebook 07's scenario: GPT shapes on 80 GiB GPUs, DGX H100 nodes
    decision_grid       {(k, n_params, gpus): Recommendation}
    decision_figure     the grid drawn, returned with it (so a test can read what was drawn)
"""

from __future__ import annotations

from zero_lab import memory
from zero_lab.course import models
from zero_lab.predict import projection

GPU_BYTES = 80 * memory.GiB
LINK = "dgx_h100"
SEQ_LEN, MICRO_BATCH = 4096, 4  # tokens a sequence, sequences a micro-batch per rank
# the course's at-scale models by Ψ, and the sizes around them (the figure's axis)
NAMED = {models.PSI_8B: "Llama 3.1 8B", models.PSI_70B: "Llama 3 70B"}
SHAPES = {models.PSI_8B: models.LLAMA3_8B, models.PSI_70B: models.LLAMA3_70B}
AT_SCALE = tuple(NAMED)
SIZES = (1.3e9, models.PSI_8B, 13e9, 30e9, models.PSI_70B, 175e9)
GPUS = (8, 16, 32, 64, 128, 256)
ACCUMULATIONS = (1, 8)
NAME = "07_stage_decision"  # the file save_figure writes, the cheat sheet links

# what a cell says, and its colour (STATE_COLORS' palette, in course/plots.py)
CHOICES = {"stage 0": ("0", "#4C72B0"), "stage 1": ("1", "#DD8452"),
           "stage 2": ("2", "#55A868"), "stage 3": ("3", "#C44E52"),
           "stage 3, gradients unsharded": ("3u", "#937860"), "HSDP": ("HSDP", "#8172B3"),
           "nothing fits": ("-", "#DDDDDD")}


def shape(n_params: float) -> dict[str, int]:
    """{"n_layers", "hidden", "heads", ...}: Llama's published shape for the course's at-scale
    models (their config.json), else `memory.gpt_shape`'s guess for Ψ (a tied head)."""
    if n_params in SHAPES:
        return dict(SHAPES[n_params])
    return memory.gpt_shape(n_params)


def label(n_params: float) -> str:
    """A row's name: "Llama 3.1 8B", "Llama 3 70B", else the size ("13B")."""
    return NAMED.get(n_params) or f"{n_params / 1e9:g}B"


def matmul_params(n_params: float) -> float:
    """The parameters that multiply: all but an untied input embedding (Llama's: a lookup,
    V·h; a guessed GPT shape ties it to the output head, which multiplies)."""
    s = shape(n_params)
    return n_params - s["vocab"] * s["hidden"] if "vocab" in s else n_params


def gpt_compute(n_params: float) -> float:
    """Seconds of one micro-batch (4 x 4,096 tokens) at 8Ψ + 16·L·h·s FLOPs a token, Ψ the
    parameters that multiply (`matmul_params`)."""
    s = shape(n_params)
    return projection.transformer_compute_time(matmul_params(n_params), MICRO_BATCH * SEQ_LEN,
                                               s["n_layers"], s["hidden"], SEQ_LEN,
                                               recompute="full")


def gpt_activations(n_params: float, attention: str = "fused") -> float:
    """One micro-batch's activations on a rank, full checkpointing per layer."""
    dims = shape(n_params)
    return memory.activation_bytes(dims["n_layers"], SEQ_LEN, MICRO_BATCH, dims["hidden"],
                                   dims["heads"], checkpointing="full", attention=attention)


def gpt_recommendation(n_params: float, gpus: int, accumulation: int = 1,
                       attention: str = "fused") -> projection.Recommendation:
    """`recommend` for a transformer (`shape`: Llama's for the at-scale models, one unit a
    layer) on `gpus` 80 GiB GPUs in DGX H100 nodes, k = `accumulation` micro-batches per
    optimizer step."""
    return projection.recommend(n_params, GPU_BYTES, gpus, LINK, gpt_compute(n_params),
                                activation_bytes=gpt_activations(n_params, attention),
                                buckets=shape(n_params)["n_layers"],
                                activations_checkpointed=True, accumulation=accumulation)


def choice(rec: projection.Recommendation) -> str:
    """A recommendation's name among CHOICES."""
    if not rec.fits:
        return "nothing fits"
    if rec.mesh:
        return "HSDP"
    if rec.stage == 3 and rec.accumulation > 1 and rec.grad_accumulation == "unsharded":
        return "stage 3, gradients unsharded"
    return f"stage {rec.stage}"


def decision_grid(sizes=SIZES, gpus=GPUS, accumulations=ACCUMULATIONS) -> dict:
    """{(k, n_params, gpus): Recommendation}, every cell `gpt_recommendation`'s answer."""
    return {(k, n, g): gpt_recommendation(n, g, k)
            for k in accumulations for n in sizes for g in gpus}


def decision_figure(sizes=SIZES, gpus=GPUS, accumulations=ACCUMULATIONS):
    """One panel per k: model size (rows) x GPU count (columns), each cell coloured by the
    stage `recommend` chose and labelled with it. Returns (figure, the grid it drew)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    grid = decision_grid(sizes, gpus, accumulations)
    names = list(CHOICES)
    fig, axes = plt.subplots(1, len(accumulations), figsize=(5.2 * len(accumulations), 4.6),
                             squeeze=False)
    cmap = ListedColormap([color for _, color in CHOICES.values()])
    for ax, k in zip(axes[0], accumulations, strict=True):
        codes = [[names.index(choice(grid[k, n, g])) for g in gpus] for n in sizes]
        ax.imshow(codes, cmap=cmap, vmin=0, vmax=len(names) - 1, aspect="auto")
        for i, n in enumerate(sizes):
            for j, g in enumerate(gpus):
                ax.text(j, i, CHOICES[choice(grid[k, n, g])][0], ha="center", va="center",
                        fontsize=9)
        ax.set_xticks(range(len(gpus)), [str(g) for g in gpus])
        ax.set_yticks(range(len(sizes)), [label(n) for n in sizes])
        ax.set_xlabel("GPUs (80 GiB, DGX H100 nodes of 8)")
        ax.set_title(f"k = {k} micro-batch{'es' if k > 1 else ''} per optimizer step")
    axes[0][0].set_ylabel("model (Llama: published shape; others: GPT shape)")
    used = sorted({choice(r) for r in grid.values()}, key=names.index)
    fig.legend(handles=[Patch(color=CHOICES[c][1], label=f"{CHOICES[c][0]}: {c}") for c in used],
               loc="lower center", ncol=len(used), frameon=False,
               bbox_to_anchor=(0.5, -0.08))
    fig.suptitle("projection.recommend: the stage chosen (4 x 4,096 tokens a micro-batch, "
                 "full recompute)")
    fig.tight_layout()
    return fig, grid
