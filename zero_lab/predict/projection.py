"""Projections beyond this machine: step time and stage choice on machines we do not have.

What the course's collectives would cost on real clusters: the alpha-beta model on the links
and machines of `links` (published figures) or this machine's fits (`OpLinks`). Every
number is a *projection* (equal links and buckets, one overlap rule for every stage): use it
for direction and scale, never as a measurement.

    project_step      one training step per stage: communication, its latency and bandwidth
                      terms, the exposed part, the step (step_time.py, re-exported here)
    peak_floor_bytes  what a step holds beyond model states and activations (N divides none)
    candidates        stages 0-3 side by side (memory with a reserve, time), a decision table;
                      on several nodes, stage 3 as HSDP too
    recommend         the stage to use: fits with the reserve, fastest, ties to less traffic;
                      with k micro-batches a step, each stage's own accumulation
                      (micro_batches.py), its reason in words (reasons.py)
    hybrid_bytes_per_step  what HSDP sends per step, inside the groups and across them
    flops_per_token   a transformer's training FLOPs a token: weights, attention, recompute
                      (flops.py, re-exported here)

What a projected step leaves out. `project_step` adds to the compute only *exposed*
communication: what a step waits for with no compute to do. Hidden communication is not free
(on shared CPU cores gloo's threads take cores; on GPUs NCCL kernels take SMs and memory
bandwidth, and a collective's time includes waiting for slow peers), so exposed time, and at
ideal overlap (`overlap = 1`) the projected step, is a lower bound. There stage 3 exposes
only its first all-gather and last reduce-scatter, at the link's peak; SM contention,
per-unit launch and copy costs, small messages' lower bandwidth and slow peers are left out.
A projected overhead of a fraction of a percent is no evidence against a measured 10-20%.

The compute (`flops_per_token`): 6Ψ FLOPs a token for the weights, 12·L·h·s for attention
at sequence length s, plus what checkpointing repeats (full: 8Ψ + 16·L·h·s in all;
selective: torchtitan's every second matmul of a block), at an assumed `MFU` of an H100's
dense bf16 peak on every FLOP done; checked against torchtitan's Llama 3.1 8B on 8 H100s
(notebook 07, tests/test_projection.py), which tests the FLOP count and the assumed MFU
together.

Checked on this machine by construction (the collectives and bytes priced are the ledger's,
notebook 07 section 2); its times against each stage's twin, the error printed, not asserted.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from zero_lab import memory
from zero_lab.predict.flops import (  # noqa: F401  (re-exported: a transformer's compute)
    H100_BF16_FLOPS,
    LLAMA3_8B,
    MFU,
    RECOMPUTE,
    every_second_matmul_share,
    flops_per_token,
    transformer_compute_time,
)
from zero_lab.predict.links import (  # noqa: F401  (re-exported: the projection's vocabulary)
    LINKS,
    MACHINES,
    Link,
    Machine,
    OpLinks,
    checked_integer,
    checked_number,
    collective_terms,
    collective_time,
    fit_link,
    fit_op_links,
    get_link,
    latency_steps,
    link_from_fit,
    max_world_size,
)
from zero_lab.predict.micro_batches import modes, state_bytes
from zero_lab.predict.reasons import (
    accumulation_words,
    gib,
    hybrid_words,
    label,
    memory_words,
    tensor_parallel_words,
    why_not,
)
from zero_lab.predict.step_time import (  # noqa: F401  (re-exported: one step's time)
    ADAM_BYTES_PER_ELEM,
    COLLECTIVES_PER_BUCKET,
    DEFAULT_BUCKETS,
    DEFAULT_OVERLAP,
    FORWARD_SHARE,
    STAGES,
    _stage,
    compute_time,
    optimizer_time,
    oversubscribed,
    project_step,
)

GiB = 2**30
# Kept free on every GPU: the CUDA context, NCCL's buffers, the allocator's fragmentation.
RESERVE_FRACTION = 0.10
# Step times closer than this are a tie: the projection cannot rank them (notebook 07 shows
# its error against measured steps).
TIE = 0.05


# ------------------------------------------------------------------ hybrid sharding


def hybrid_bytes_per_step(group_numels, stage: int, replicas: int, shards: int,
                          bytes_per_elem: int = 4) -> dict[str, dict[str, int]]:
    """What one rank's collectives carry in one training step on an R x S hybrid layout
    (stages/hybrid.py), per level and op: {"shard": {op: bytes}, "replicate": {op: bytes}},
    each op's full messages summed as CommLedger.by_level() counts them.

    Each flat group (a stage-3 unit, a stage 0-2 bucket) of Ψ_g elements is padded to
    P_g = S·ceil(Ψ_g / S) and sharded over the S ranks of a group:
        inside the group     stage 3: all-gather P_g twice (forward, backward),
                             reduce-scatter P_g; stages 0-2: reduce-scatter P_g, all-gather
                             P_g (stage 0's hierarchical all-reduce is those two)
        across the groups    all-reduce of the averaged slice, P_g / S
    """
    stage = _stage(stage)
    checked_integer("replicas", replicas)  # R sets the ring's share of the all-reduce, not its size
    s = checked_integer("shards", shards)
    padded = [s * -(-checked_integer("group numel", n) // s) for n in group_numels]
    total = sum(padded) * bytes_per_elem
    inside = {"all_gather": (2 if stage == 3 else 1) * total, "reduce_scatter": total}
    return {"shard": inside, "replicate": {"all_reduce": total // s}}


# ------------------------------------------------------------------ choosing a stage


# Units (Ψ/buckets elements, working precision) a step holds above its model states at its
# peak, measured in notebook 07's section 1 (N = 1024): stage 0 a bucket being all-reduced;
# stage 1 a unit's gradients in flight; stage 2 a unit's gradients, its bucket copy and the
# next in flight; stage 3 the unit computed and the one prefetched, their gradients, one more.
FLOOR_UNITS = {0: 1, 1: 1, 2: 3, 3: 5}


def peak_floor_bytes(n_params: float, stage: int, buckets: int = DEFAULT_BUCKETS,
                     precision: str = "mixed") -> float:
    """Bytes a step holds above model states and activations, which no N divides:
    FLOOR_UNITS[stage] units of Ψ/buckets parameters in the working precision."""
    checked_number("n_params", n_params)
    stage = _stage(stage)
    k = checked_integer("buckets", buckets)
    elem = memory.bytes_per_param(precision)["params"]
    return FLOOR_UNITS[stage] * n_params / k * elem


@dataclass(frozen=True)
class Recommendation:
    """The stage `recommend` chose, and why, in words with the numbers."""

    stage: int
    fits: bool  # the stage meets every constraint (memory with its reserve, max_step_s)
    headroom_bytes: float  # gpu_bytes - per_rank_bytes: must stay >= reserve_bytes
    per_rank_bytes: float  # model states + activations + peak floor on one rank
    step_s: float
    comm_share: float
    reason: str
    mesh: tuple[int, int] | None = None  # stage 3 as HSDP: (replicas, shards); None: flat
    accumulation: int = 1  # micro-batches per optimizer step, k
    grad_accumulation: str = "sharded"  # how the stage accumulates (micro_batches.MODES)


def hybrid_mesh(world_size: int, link) -> tuple[int, int] | None:
    """HSDP's layout on `link`: (nodes, GPUs per node) when it is a Machine and the N ranks
    span two or more whole nodes; else None (on one node HSDP is stage 3 itself)."""
    lk = get_link(link)
    if not isinstance(lk, Machine):
        return None
    g = lk.node_size
    return (world_size // g, g) if world_size > g and world_size % g == 0 else None


def candidates(n_params: float, gpu_bytes: float, world_size: int, link, compute_s: float,
               precision: str = "mixed", optimizer: str = "adam",
               activation_bytes: float = 0, max_step_s: float | None = None, *,
               buckets: int = DEFAULT_BUCKETS, overlap: float = DEFAULT_OVERLAP,
               gather_after_step: bool = False,
               reserve_fraction: float = RESERVE_FRACTION, stages=STAGES,
               hybrid: bool = True, accumulation: int = 1) -> list[dict]:
    """Stages 0-3 (those in `stages`) side by side, one dict each, for a decision table; with
    `hybrid` on two or more whole nodes of a Machine, one more row: stage 3 as HSDP
    (`hybrid_mesh`), its states sharded over S = node_size ranks, not N.

    Keys: stage, model_state_bytes (`memory.model_state_bytes`, per rank), activation_bytes,
    floor_bytes (`peak_floor_bytes`), per_rank_bytes (their sum), reserve_bytes
    (reserve_fraction x gpu_bytes), headroom_bytes (gpu_bytes - per_rank_bytes),
    fits_memory (headroom >= reserve), step_s, comm_share, volume_psi, collectives (from
    `project_step`, in the working precision), meets_time (step_s <= max_step_s), mesh
    (None, or HSDP's (replicas, shards)), network_bytes (one GPU's, over the network),
    accumulation and grad_accumulation (`micro_batches`).

    `accumulation`: micro-batches per optimizer step, k (`compute_s` and `activation_bytes`
    are one micro-batch's; step_s is the optimizer step's). Each stage accumulates as it
    really does (`micro_batches.MODES`): stages 0-1 send once, stage 2 reduce-scatters every
    micro-batch ((k+1)Ψ), stage 3 gathers and reduce-scatters every micro-batch (3kΨ); with
    k > 1 one more row, stage 3 holding its full gradients between micro-batches
    (FSDP2's set_requires_gradient_sync(False): (2k+1)Ψ, the gradients' memory unsharded).
    """
    checked_number("n_params", n_params)
    checked_integer("world_size", world_size)
    checked_integer("buckets", buckets)
    checked_number("gpu_bytes", gpu_bytes)
    checked_number("activation_bytes", activation_bytes, strict=False)
    checked_number("reserve_fraction", reserve_fraction, strict=False, top=0.9)
    if max_step_s is not None:
        checked_number("max_step_s", max_step_s)
    micro = checked_integer("accumulation", accumulation)
    elem = memory.bytes_per_param(precision, optimizer)["params"]  # what grads are sent in
    reserve = reserve_fraction * gpu_bytes
    stages = _menu(stages)
    mesh = hybrid_mesh(world_size, link) if hybrid and 3 in stages else None
    layouts = [(stage, None, mode) for stage in stages for mode in modes(stage, micro)]
    layouts += [(3, mesh, "sharded")] if mesh else []
    rows = []
    for stage, layout, mode in layouts:
        replicas, shards = layout or (1, world_size)  # HSDP: stage 3's states over S ranks
        states = state_bytes(n_params, stage, shards, precision, optimizer, mode, micro)
        floor = peak_floor_bytes(n_params, stage, buckets, precision)
        step = project_step(n_params, stage, world_size, link, compute_s, elem, buckets,
                            overlap, gather_after_step, replicas, accumulation=micro,
                            grad_accumulation=mode)
        total = states + activation_bytes + floor
        rows.append({
            "stage": stage, "mesh": layout, "model_state_bytes": states,
            "accumulation": micro, "grad_accumulation": mode,
            "activation_bytes": activation_bytes, "floor_bytes": floor,
            "per_rank_bytes": total, "reserve_bytes": reserve,
            "headroom_bytes": gpu_bytes - total, "fits_memory": gpu_bytes - total >= reserve,
            "step_s": step["step_s"], "comm_share": step["comm_share"],
            "volume_psi": step["volume_psi"], "collectives": step["collectives"],
            "meets_time": max_step_s is None or step["step_s"] <= max_step_s,
            "network_bytes": step["network_bytes"],
        })
    return rows


def _menu(stages) -> tuple[int, ...]:
    """The stages a framework offers (FSDP2: (0, 3)), checked: 3 must be among them."""
    try:
        menu = tuple(sorted({_stage(s) for s in stages}))
    except TypeError:
        raise ValueError(f"stages must be a collection of 0, 1, 2, 3; got {stages!r}") from None
    if 3 not in menu:
        raise ValueError(f"stages must include 3, the stage that fits when no other does; "
                         f"got {stages!r}")
    return menu


def _ranks_for_stage3(n_params, gpu_bytes, world_size, link, rows, precision, optimizer,
                      reserve_fraction):
    """Fewest ranks (whole nodes on a Machine) at which stage 3 fits with its reserve, or
    None if none can (activations and floor do not depend on N).

    In closed form: at stage 3 a rank holds bytes_per_param x ceil(Ψ/N) bytes of states
    (memory.model_state_bytes), which fit in `room` exactly when ceil(Ψ/N) <= m, the whole
    parameters the room holds, that is when N >= ceil(Ψ/m).
    """
    flat3 = next(r for r in rows if r["stage"] == 3 and r["mesh"] is None)
    room = gpu_bytes * (1 - reserve_fraction) - flat3["activation_bytes"] - flat3["floor_bytes"]
    per_param = memory.bytes_per_param(precision, optimizer)["total"]
    most = Fraction(room) // per_param  # parameters one rank can hold (exact: no rounding)
    if most < 1:
        return None  # not even one parameter per rank would fit
    lk = get_link(link)
    node = lk.node_size if isinstance(lk, Machine) else 1
    n = max(world_size + 1, -(-int(n_params) // most))  # more ranks than now, and enough
    if n > node:
        n = -(-n // node) * node  # whole nodes
    top = max_world_size(lk)
    return n if top is None or n <= top else None


def recommend(n_params: float, gpu_bytes: float, world_size: int, link, compute_s: float,
              precision: str = "mixed", optimizer: str = "adam",
              activation_bytes: float = 0, max_step_s: float | None = None, *,
              buckets: int = DEFAULT_BUCKETS, overlap: float = DEFAULT_OVERLAP,
              gather_after_step: bool = False, reserve_fraction: float = RESERVE_FRACTION,
              activations_checkpointed: bool = False, stages=STAGES,
              hybrid: bool = True, accumulation: int = 1) -> Recommendation:
    """The stage to use, with the numbers (`candidates`) and the reason in words.

    1. A stage fits if one rank's states + activations + peak floor leave the reserve
       (reserve_fraction of the GPU) free, and meets max_step_s if given.
    2. Stage 3 on several nodes of a Machine runs as HSDP (`hybrid`, `hybrid_mesh`) when
       that fits and is no slower: its all-gathers stay inside the node.
    3. Of those, every stage whose projected step is within TIE (5%) of the fastest ties:
       the projection cannot tell them apart.
    4. Ties go to less communication (the paper's volume: 2Ψ before 3Ψ; then fewer
       collectives per step: stage 0's one all-reduce per bucket before a reduce-scatter
       and an all-gather the next forward waits for), then to more headroom.
    So: stage 0 while the model fits replicated, stage 2 when it does not, stage 3 when only
    it fits, as HSDP if a node holds its states. With `accumulation` = k > 1 micro-batches
    per optimizer step (`candidates`), rule 4 weighs each stage's bytes per optimizer step:
    stage 1 (2Ψ) before stage 2 ((k+1)Ψ) wherever stage 1 fits. `stages` is the menu (e.g.
    (0, 3): what FSDP2 offers); it must include 3. If nothing fits: stage 3 with fits=False and what
    would fit; if some fit but none is fast enough, the fastest that fits.
    """
    rows = candidates(n_params, gpu_bytes, world_size, link, compute_s, precision, optimizer,
                      activation_bytes, max_step_s, buckets=buckets, overlap=overlap,
                      gather_after_step=gather_after_step, reserve_fraction=reserve_fraction,
                      stages=stages, hybrid=hybrid, accumulation=accumulation)
    fitting = [r for r in rows if r["fits_memory"]]
    ok = [r for r in fitting if r["meets_time"]]
    hsdp = [r for r in ok if r["mesh"]]
    if hsdp:  # rule 2: stage 3 runs as HSDP, unless flat stage 3 were faster
        ok = [r for r in ok if not (r["stage"] == 3 and r["mesh"] is None
                                    and hsdp[0]["step_s"] <= r["step_s"] * (1 + TIE))]
    flat3 = next(r for r in rows if r["stage"] == 3 and r["mesh"] is None)
    reserve = f"{gib(rows[0]['reserve_bytes'])} reserve"
    if ok:
        fastest = min(r["step_s"] for r in ok)
        tied = [r for r in ok if r["step_s"] <= fastest * (1 + TIE)]
        row = min(tied, key=lambda r: (r["volume_psi"], r["collectives"], -r["headroom_bytes"]))
        reason = (f"{label(row)}: {memory_words(row)} leave "
                  f"{gib(row['headroom_bytes'])} of {gib(gpu_bytes)} free (>= {reserve}), "
                  f"projected step {row['step_s']:.3g} s ({row['comm_share']:.1%} waiting on "
                  f"communication)")
        others = [why_not(r, row) for r in tied if r is not row]
        if others:
            reason += "; ties within 5% with " + ", ".join(others)
        lower = [r for r in rows if r["mesh"] is None and r["stage"] < row["stage"]
                 and not r["fits_memory"]]
        if lower:
            reason += f"; stage {lower[-1]['stage']} needs {gib(lower[-1]['per_rank_bytes'])}"
        reason += accumulation_words(row, rows, tied)
        if row["stage"] == 3:
            reason += hybrid_words(row, rows)
        slow = [r for r in fitting if not r["meets_time"]]
        if slow:
            reason += (f"; {label(slow[0])} fits but projects {slow[0]['step_s']:.3g} s "
                       f"per step, over max_step_s {max_step_s:g} s")
    elif fitting:
        row = min(fitting, key=lambda r: r["step_s"])
        reason = (f"{label(row)} fits in memory ({gib(row['per_rank_bytes'])} of "
                  f"{gib(gpu_bytes)}) but its projected step {row['step_s']:.3g} s is over "
                  f"max_step_s {max_step_s:g} s, the fastest of the stages that fit; a faster "
                  f"link or fewer, larger buckets would cut the communication")
    else:
        row = flat3  # stage 3 with its gradients sharded: the least a rank can hold
        reason = (f"nothing fits: stage 3 needs {gib(row['per_rank_bytes'])} per rank "
                  f"({memory_words(row)}) and the {reserve}, on {gib(gpu_bytes)}")
        ranks = _ranks_for_stage3(n_params, gpu_bytes, world_size, link, rows, precision,
                                  optimizer, reserve_fraction)
        shrink = ("a smaller micro-batch" if activations_checkpointed else
                  "activation checkpointing or a smaller micro-batch")
        if ranks is None:
            reason += f"; the activations alone do not fit: {shrink}"
        else:
            reason += (f"; stage 3 fits on {ranks} ranks, or offload the optimizer states "
                       f"to CPU (ZeRO-Offload), or {shrink}")
        lk = get_link(link)
        reason += tensor_parallel_words(row, gpu_bytes, reserve_fraction, world_size,
                                        lk.node_size if isinstance(lk, Machine) else 8)
    return Recommendation(stage=row["stage"], fits=bool(ok), headroom_bytes=row["headroom_bytes"],
                          per_rank_bytes=row["per_rank_bytes"], step_s=row["step_s"],
                          comm_share=row["comm_share"], reason=reason, mesh=row["mesh"],
                          accumulation=row["accumulation"],
                          grad_accumulation=row["grad_accumulation"])
