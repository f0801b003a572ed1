"""When the memory stage 3 frees pays for turning recompute off: pure arithmetic, no torch.

Recompute (activation checkpointing per layer, `shard(..., checkpoint_activations=True)`)
trades FLOPs for memory: a layer keeps only its input, 2·s·b·h bytes instead of 34·s·b·h
(zero_lab.memory.activation_bytes_per_layer), and pays one more forward: 8Ψ + 16·L·h·s
FLOPs per token instead of 6Ψ + 12·L·h·s (forward 2Ψ, backward 4Ψ, recompute 2Ψ, and
attention's share; `projection.flops_per_token`), about a third more compute. ZeRO stage 3
frees model-state memory instead, for 1.5x the bytes. On a GPU of a given size the two meet:
a stage that does not shard the parameters may need recompute to fit, where stage 3 fits
without it and runs a quarter fewer FLOPs.

    per_rank_peak(...)          model states + activations + the stage's peak floor, bytes
    choose(gpu_bytes, ...)      per stage: "off" (fits without recompute, the cheaper),
                                "on" (fits only with it), or None (fits neither way);
                                fitting keeps notebook 07's reserve free (`projection`)
    decisive_budgets(peaks)     from *measured* peaks: the budgets where stage 1 needs
                                recompute and stage 3 does not, [low, high)
"""

from __future__ import annotations

from zero_lab import memory
from zero_lab.predict import projection

STAGES = (0, 1, 2, 3)


def per_rank_peak(n_params: float, stage: int, world_size: int, n_layers: int, seq_len: int,
                  batch: int, hidden: int, heads: int, recompute: bool,
                  precision: str = "mixed", optimizer: str = "adam",
                  attention: str = "fused") -> float:
    """Bytes one rank holds at its peak: `memory.model_state_bytes`, the micro-batch's
    activations (`memory.activation_bytes`, "full" checkpointing per layer when `recompute`)
    and what the stage holds above both (`projection.peak_floor_bytes`, one unit per layer)."""
    states = memory.model_state_bytes(n_params, stage, world_size, precision, optimizer)
    acts = memory.activation_bytes(n_layers, seq_len, batch, hidden, heads,
                                   checkpointing="full" if recompute else "none",
                                   attention=attention)
    floor = projection.peak_floor_bytes(n_params, stage, buckets=n_layers, precision=precision)
    return states["total"] + acts + floor


def choose(gpu_bytes: float, n_params: float, world_size: int, n_layers: int, seq_len: int,
           batch: int, hidden: int, heads: int, *,
           reserve_fraction: float = projection.RESERVE_FRACTION,
           **kwargs) -> dict[int, str | None]:
    """{stage: "off" | "on" | None}: recompute off when the stage fits without it (fewer
    FLOPs), on when it fits only with it, None when it fits neither way. A stage fits as in
    `projection.recommend`: its peak (`per_rank_peak`, the floor included) leaves
    reserve_fraction of the GPU free for the CUDA context, NCCL and fragmentation."""
    budget = gpu_bytes * (1 - reserve_fraction)
    out: dict[int, str | None] = {}
    for stage in STAGES:
        peaks = {r: per_rank_peak(n_params, stage, world_size, n_layers, seq_len, batch,
                                  hidden, heads, r, **kwargs) for r in (False, True)}
        out[stage] = "off" if peaks[False] <= budget else (
            "on" if peaks[True] <= budget else None)
    return out


def choose_measured(peaks: dict[tuple[int, bool], int], budget: float) -> dict[int, str | None]:
    """`choose` on measured peaks {(stage, recompute): bytes} against a budget in bytes."""
    out: dict[int, str | None] = {}
    for stage in sorted({s for s, _ in peaks}):
        out[stage] = "off" if peaks[stage, False] <= budget else (
            "on" if peaks[stage, True] <= budget else None)
    return out


def decisive_budgets(peaks: dict[tuple[int, bool], int], low_stage: int = 1,
                     high_stage: int = 3) -> tuple[int, int] | None:
    """The budgets [low, high) in which `low_stage` fits only with recompute while
    `high_stage` fits without it, from measured peaks {(stage, recompute): bytes}; None if
    there are none (recompute saves less than stage 3 frees, or the other way round)."""
    low = max(peaks[high_stage, False], peaks[low_stage, True])
    high = peaks[low_stage, False]
    return (low, high) if low < high else None
