"""Projections beyond this machine: step time and stage choice on machines we do not have.

The course measures ZeRO on a few CPU ranks over gloo; this module asks what the same
collectives would cost on real clusters, with the alpha-beta model and the links and
machines of `interconnect` (published figures) or this machine's own fits (`OpLinks`: each
collective priced by the transport that really sends it here). Every number it returns is a
*projection*: ring, hierarchical or direct-exchange collectives on equal links, equal
buckets, and one overlap rule for every stage (`project_step`). Use it to reason about direction and
scale (is stage 2 nearly free here? does stage 3 pay off on this link?), never as a
measurement.

    project_step      one training step per stage: communication, its latency and bandwidth
                      terms, the exposed part, the step
    peak_floor_bytes  what a step holds beyond model states and activations (N divides none)
    candidates        stages 0-3 side by side (memory with a reserve, time), a decision table;
                      on a Machine of several nodes, stage 3 as HSDP too (sharded inside a
                      node, replicated across nodes: `project_step(..., replicas=R)`)
    recommend         the stage to use: fits with the reserve, fastest, ties broken toward
                      less communication, then more headroom
    hybrid_bytes_per_step  what HSDP sends per step, inside the groups and across them
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from fractions import Fraction
from numbers import Integral

from zero_lab import memory
from zero_lab.collectives.cost_model import ring_bytes_sent, ring_steps, zero_volume
from zero_lab.interconnect import (  # noqa: F401  (re-exported: the projection's vocabulary)
    LINKS,
    MACHINES,
    Link,
    Machine,
    OpLinks,
    collective_terms,
    collective_time,
    fit_link,
    fit_op_links,
    get_link,
    latency_steps,
    link_from_fit,
    max_world_size,
)
from zero_lab.interconnect import _integer as _checked_integer
from zero_lab.interconnect import _number as _checked_number

STAGES = (0, 1, 2, 3)
GiB = 2**30

# One pass over the parameters is split into this many collectives by default: about one per
# transformer layer of a 7B model (32 layers), the unit FSDP wraps. DDP's 25 MB buckets would
# mean ~560 collectives for the same model, and a latency term ~17x larger.
DEFAULT_BUCKETS = 32
# Ideal overlap: all hideable communication runs under compute (a lower bound on step time).
DEFAULT_OVERLAP = 1.0
FORWARD_SHARE = 1 / 3  # backward costs about twice the forward's FLOPs (Kaplan et al. 2020)
# Kept free on every GPU: the CUDA context, NCCL's buffers, the allocator's fragmentation.
RESERVE_FRACTION = 0.10
# Step times closer than this are a tie: the projection cannot rank them (notebook 07 shows
# its error against measured steps).
TIE = 0.05


def _too_large(name: str, value) -> None:
    """Refuse an int no float can hold (10**400): the projection computes in floats, where
    it would raise OverflowError far from the argument that caused it."""
    if isinstance(value, Integral) and not isinstance(value, bool) and \
            abs(value) > sys.float_info.max:
        raise ValueError(f"{name} is too large for a float: an int of {value.bit_length()} "
                         f"bits, where a float holds less than 2**1024")


def _number(name: str, value, **bounds):
    """interconnect's check (a finite real within bounds), an oversized int refused too."""
    _too_large(name, value)
    return _checked_number(name, value, **bounds)


def _integer(name: str, value, minimum: int = 1) -> int:
    _too_large(name, value)
    return _checked_integer(name, value, minimum)


def _stage(stage) -> int:
    if not isinstance(stage, Integral) or isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be one of 0, 1, 2, 3; got {stage!r}")
    return int(stage)


def compute_time(n_params: float, tokens: float, flops_per_s: float) -> float:
    """Seconds of forward + backward compute: 6 x Ψ x tokens / achieved FLOP/s.

    6Ψ FLOPs per token (2 forward, 4 backward) is the usual dense-transformer count
    (Kaplan et al. 2020, section 2.1), ignoring attention's s^2 term. Use it to project a
    `compute_s` where there is no measurement; `flops_per_s` is what is *achieved* (for an
    H100's 989 dense bf16 TFLOP/s, 40% utilisation gives about 4e14).
    """
    _number("n_params", n_params)
    _number("tokens", tokens)
    _number("flops_per_s", flops_per_s)
    return 6.0 * n_params * tokens / flops_per_s


def oversubscribed(compute_s: float, world_size: int, cores: int) -> float:
    """One rank's compute when `world_size` single-threaded ranks share `cores` cores: each
    gets cores/N of a core once N > cores, so its compute stretches by N/cores."""
    _number("compute_s", compute_s)
    n, c = _integer("world_size", world_size), _integer("cores", cores)
    return compute_s * max(1.0, n / c)


# ------------------------------------------------------------------ one training step


COLLECTIVES_PER_BUCKET = {0: 1, 1: 2, 2: 2, 3: 3}


def _collectives(stage: int, k: int) -> dict[str, int]:
    """Collectives per step, each a bucket (unit) of Ψ/k parameters."""
    if stage == 0:
        return {"all_reduce": k}                      # gradients: 2Ψ
    if stage in (1, 2):
        return {"reduce_scatter": k, "all_gather": k}  # gradients, then parameters: Ψ + Ψ
    return {"all_gather": 2 * k, "reduce_scatter": k}  # forward, backward, gradients: 3Ψ


def project_step(n_params: float, stage: int, world_size: int, link, compute_s: float,
                 bytes_per_elem: int = 2, buckets: int = DEFAULT_BUCKETS,
                 overlap: float = DEFAULT_OVERLAP, gather_after_step: bool = False,
                 replicas: int = 1) -> dict:
    """One data-parallel training step at ZeRO `stage`, projected on `link` (a Link or a
    Machine, or its name; or an OpLinks, which prices each kind of collective on its own
    link: this machine's all-reduce as gloo's ring, its reduce-scatters and all-gathers as
    the direct exchange's one round).

    Collectives (`_collectives`: Ψ x bytes_per_elem / buckets bytes each, `collective_terms`):
    stage 0 all-reduces the gradients; stages 1 and 2 reduce-scatter them and all-gather the
    updated parameters (they differ in memory only); stage 3 all-gathers each unit in
    forward and again in backward and reduce-scatters its gradients.

    The overlap rule, the same for every stage. A collective hides only under compute that
    runs while it is in flight (forward = compute_s / 3, backward = 2 compute_s / 3; weak
    scaling: compute_s, one rank's batch, is fixed as N grows):
      - parameter all-gathers are issued ahead of the forward that uses them (prefetch): all
        but the first bucket's run under forward. Stages 1-2's gather of the updated
        parameters is one of them (done bucket by bucket at the next forward, as FSDP's
        SHARD_GRAD_OP does); stage 3's backward re-gathers run under backward, but the first.
      - gradient reductions start as each bucket's gradients are ready: all but the last
        bucket's run under backward.
      - of what could hide, the fraction `overlap` does (1: ideal; 0: none), never more than
        the phase's compute; collectives share the link one at a time (their times add).
    `gather_after_step=True` describes implementations that all-gather the parameters after
    the optimizer step instead (this course's stages 1-2, DeepSpeed ZeRO-1/2): nothing
    computes then, so by the same rule none of that gather hides.
    `replicas=R` > 1 (stage 3 only): hybrid sharding (HSDP, stages/hybrid.py) on R groups of
    S = N/R ranks. Its all-gathers and reduce-scatters run on the S ranks of a group (on a
    Machine, S must be whole nodes: with S = node_size they never leave NVLink); each
    reduce-scatter is followed by an all-reduce of its 1/S slice across the R groups
    (`_across_terms`), in backward, under the same rule.

    Returns {"stage", "world_size", "link", "compute_s", "comm_s" (per collective kind),
    "comm_total_s", "latency_s" and "bandwidth_s" (comm_total_s's two terms),
    "bytes_sent" (per rank), "volume_psi" (the ZeRO paper's volume, in Ψ: 2, 2, 2, 3),
    "collectives" (per step), "calls" (per step, by kind), "exposed_s", "step_s"
    (compute_s + exposed_s), "comm_share", "network_bytes" (what one GPU sends over a
    Machine's network per step; 0 inside one node or on a Link), "replicas"}.
    """
    _number("n_params", n_params)
    stage = _stage(stage)
    n = _integer("world_size", world_size)
    lk = get_link(link)
    _number("compute_s", compute_s)
    _number("bytes_per_elem", bytes_per_elem)
    k = _integer("buckets", buckets)
    _number("overlap", overlap, strict=False, top=1.0)
    if not isinstance(gather_after_step, bool):
        raise ValueError(f"gather_after_step must be True or False; got {gather_after_step!r}")
    r = _integer("replicas", replicas)
    if r > 1 and (stage != 3 or n % r):
        raise ValueError(f"replicas={r} is hybrid sharding: stage 3 on a world size it divides; "
                         f"got stage {stage}, world_size {n}")
    s = n // r  # the ranks a unit is sharded over

    bucket = n_params * bytes_per_elem / k  # one collective's full message
    calls = _collectives(stage, k)
    terms = {op: collective_terms(op, bucket, s, lk) for op in calls}
    sizes = {op: (bucket, s) for op in calls}  # (message, ranks) of each kind
    if r > 1:  # every gradient slice is then all-reduced across the groups
        terms["all_reduce"] = _across_terms(bucket / s, r, s, lk)
        calls["all_reduce"] = k
        sizes["all_reduce"] = (bucket / s, r)
    one = {op: t["latency_s"] + t["bandwidth_s"] for op, t in terms.items()}
    forward, backward = compute_s * FORWARD_SHARE, compute_s * (1 - FORWARD_SHARE)
    # phases: (seconds of communication, seconds of it that can never hide, compute under it)
    if stage == 0:
        phases = [(k * one["all_reduce"], one["all_reduce"], backward)]
    elif stage in (1, 2):
        gather, scatter = one["all_gather"], one["reduce_scatter"]
        params = (k * gather, k * gather, 0.0) if gather_after_step else (k * gather, gather,
                                                                          forward)
        phases = [params, (k * scatter, scatter, backward)]
    else:
        gather, scatter = one["all_gather"], one["reduce_scatter"] + one.get("all_reduce", 0.0)
        phases = [(k * gather, gather, forward),
                  (k * (gather + scatter), gather + scatter, backward)]
    exposed = sum(total - min(overlap * (total - always), under)
                  for total, always, under in phases)
    comm = {op: count * one[op] for op, count in calls.items()}
    step = compute_s + exposed
    return {
        "stage": stage, "world_size": n, "link": lk.name, "compute_s": compute_s,
        "comm_s": comm, "comm_total_s": sum(comm.values()),
        "latency_s": sum(c * terms[op]["latency_s"] for op, c in calls.items()),
        "bandwidth_s": sum(c * terms[op]["bandwidth_s"] for op, c in calls.items()),
        "bytes_sent": sum(c * ring_bytes_sent(op, *sizes[op]) for op, c in calls.items()),
        "volume_psi": sum(c * zero_volume(op, sizes[op][0] / bucket)
                          for op, c in calls.items()) / k,
        "collectives": sum(calls.values()), "calls": dict(calls),
        "exposed_s": exposed, "step_s": step, "comm_share": exposed / step,
        "network_bytes": sum(c * _network_bytes(op, *sizes[op], lk, across=r > 1 and op ==
                                                "all_reduce") for op, c in calls.items()),
        "replicas": r,
    }


def _across_terms(nbytes: float, replicas: int, shards: int, link) -> dict[str, float]:
    """HSDP's all-reduce of a gradient slice (`nbytes`) across R groups of S ranks.

    On a Machine, S must be whole nodes: the R ranks holding the same slice sit on R
    different nodes, and every GPU of a node runs its own all-reduce at once, through the
    node's NICs (the network ring of `collective_terms`, each GPU's share of its node's
    ports). On a Link or an OpLinks, a ring of R ranks on that link (its all-reduce's)."""
    lk = get_link(link)
    if not isinstance(lk, Machine):
        return collective_terms("all_reduce", nbytes, replicas, lk)
    g = lk.node_size
    if shards % g:
        raise ValueError(f"hybrid sharding on {lk.name} shards over whole nodes: S = "
                         f"{shards} is not a multiple of {g} GPUs per node")
    net_beta = lk.inter.beta * g / lk.nics_per_node
    return {"latency_s": ring_steps("all_reduce", replicas) * lk.inter.alpha,
            "bandwidth_s": ring_bytes_sent("all_reduce", nbytes, replicas) * net_beta}


def _network_bytes(op: str, nbytes: float, n: int, link, across: bool = False) -> float:
    """Bytes one GPU sends over a Machine's network for one collective of `n` ranks (0 on a
    Link, or inside one node): the network ring's share of the node's 1/g of the message
    (`collective_terms`); HSDP's all-reduce `across` the groups crosses it whole."""
    lk = get_link(link)
    if not isinstance(lk, Machine) or (n <= lk.node_size and not across):
        return 0.0
    if across:
        return ring_bytes_sent(op, nbytes, n)
    m = n // lk.node_size
    half = "reduce_scatter" if op in ("reduce_scatter", "all_reduce") else "all_gather"
    return (2 if op == "all_reduce" else 1) * ring_bytes_sent(half, nbytes / lk.node_size, m)


# ------------------------------------------------------------------ hybrid sharding


def hybrid_bytes_per_step(group_numels, stage: int, replicas: int, shards: int,
                          bytes_per_elem: int = 4) -> dict[str, dict[str, int]]:
    """What one rank's collectives carry in one training step on an R x S hybrid layout
    (stages/hybrid.py), per level and op: {"shard": {op: bytes}, "replicate": {op: bytes}},
    each op's full messages summed as CommLedger.by_level() counts them (nccl-tests' size:
    the reduce-scatter's input, the all-gather's output).

    Each flat group (a stage-3 unit, a stage 0-2 bucket) of Ψ_g elements is padded to
    P_g = S·ceil(Ψ_g / S) and sharded over the S ranks of a group:
        inside the group     stage 3: all-gather P_g twice (forward, backward),
                             reduce-scatter P_g; stages 0-2: reduce-scatter P_g, all-gather
                             P_g (stage 0's hierarchical all-reduce is those two)
        across the groups    all-reduce of the averaged slice, P_g / S
    """
    stage = _stage(stage)
    _integer("replicas", replicas)  # R sets the ring's share of the all-reduce, not its size
    s = _integer("shards", shards)
    padded = [s * -(-_integer("group numel", n) // s) for n in group_numels]
    total = sum(padded) * bytes_per_elem
    inside = {"all_gather": (2 if stage == 3 else 1) * total, "reduce_scatter": total}
    return {"shard": inside, "replicate": {"all_reduce": total // s}}


# ------------------------------------------------------------------ choosing a stage


# Units (Ψ/buckets elements, in the working precision) a step holds above its model states
# at its peak, measured in notebook 07's first section (this course's stages, N = 1024, where
# the states are nearly gone): stage 0 one bucket being all-reduced; stage 1 one unit's
# gradients in flight; stage 2 a unit's gradients, its bucket copy and the next in flight;
# stage 3 the unit computed and the one prefetched, their full gradients, one in flight.
FLOOR_UNITS = {0: 1, 1: 1, 2: 3, 3: 5}


def peak_floor_bytes(n_params: float, stage: int, buckets: int = DEFAULT_BUCKETS,
                     precision: str = "mixed") -> float:
    """Bytes a step holds above model states and activations, which no N divides:
    FLOOR_UNITS[stage] units of Ψ/buckets parameters in the working precision."""
    _number("n_params", n_params)
    stage = _stage(stage)
    k = _integer("buckets", buckets)
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


def hybrid_mesh(world_size: int, link) -> tuple[int, int] | None:
    """HSDP's layout on `link`: (nodes, GPUs per node) when it is a Machine and the N ranks
    span whole nodes, two or more (the shard group is a node); else None (on one node HSDP
    is stage 3 itself)."""
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
               hybrid: bool = True) -> list[dict]:
    """Stages 0-3 (those in `stages`) evaluated side by side, one dict each, for a decision
    table; with `hybrid` and stage 3 on a Machine of two or more whole nodes, one more row
    after them: stage 3 as HSDP (`hybrid_mesh`: sharded over each node's GPUs, replicated
    across the nodes), which holds stage 3's states over S = node_size ranks, not N.

    Keys: stage, model_state_bytes (`memory.model_state_bytes`, per rank), activation_bytes,
    floor_bytes (`peak_floor_bytes`), per_rank_bytes (their sum), reserve_bytes
    (reserve_fraction x gpu_bytes), headroom_bytes (gpu_bytes - per_rank_bytes),
    fits_memory (headroom >= reserve), step_s, comm_share, volume_psi, collectives (from
    `project_step`, communicating in the working precision), meets_time (step_s <=
    max_step_s, True without a budget), mesh (None, or HSDP's (replicas, shards)),
    network_bytes (what one GPU sends over the network per step).
    """
    _number("n_params", n_params)
    _integer("world_size", world_size)
    _integer("buckets", buckets)
    _number("gpu_bytes", gpu_bytes)
    _number("activation_bytes", activation_bytes, strict=False)
    _number("reserve_fraction", reserve_fraction, strict=False, top=0.9)
    if max_step_s is not None:
        _number("max_step_s", max_step_s)
    elem = memory.bytes_per_param(precision, optimizer)["params"]  # what grads are sent in
    reserve = reserve_fraction * gpu_bytes
    stages = _menu(stages)
    mesh = hybrid_mesh(world_size, link) if hybrid and 3 in stages else None
    layouts = [(stage, None) for stage in stages] + ([(3, mesh)] if mesh else [])
    rows = []
    for stage, layout in layouts:
        replicas, shards = layout or (1, world_size)  # HSDP: stage 3's states over S ranks
        states = memory.model_state_bytes(n_params, stage, shards, precision, optimizer)
        floor = peak_floor_bytes(n_params, stage, buckets, precision)
        step = project_step(n_params, stage, world_size, link, compute_s, elem, buckets,
                            overlap, gather_after_step, replicas)
        total = states["total"] + activation_bytes + floor
        rows.append({
            "stage": stage, "mesh": layout, "model_state_bytes": states["total"],
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
    """The stages a framework offers (FSDP2: (0, 3), with hybrid sharding), checked: stage 3,
    the one that fits last, must be among them."""
    try:
        menu = tuple(sorted({_stage(s) for s in stages}))
    except TypeError:
        raise ValueError(f"stages must be a collection of 0, 1, 2, 3; got {stages!r}") from None
    if 3 not in menu:
        raise ValueError(f"stages must include 3, the stage that fits when no other does; "
                         f"got {stages!r}")
    return menu


def _label(row: dict) -> str:
    """How a row is named in a reason: "stage 2", or "stage 3 as HSDP (8 x 8)"."""
    if row.get("mesh"):
        return f"stage 3 as HSDP ({row['mesh'][0]} x {row['mesh'][1]})"
    return f"stage {row['stage']}"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def _memory_words(row: dict) -> str:
    words = f"states {_gib(row['model_state_bytes'])}"
    if row["activation_bytes"]:
        words += f" + activations {_gib(row['activation_bytes'])}"
    if row["floor_bytes"]:
        words += f" + floor {_gib(row['floor_bytes'])}"
    return words


def _ranks_for_stage3(n_params, gpu_bytes, world_size, link, rows, precision, optimizer,
                      reserve_fraction):
    """Fewest ranks (whole nodes on a Machine) at which stage 3 fits with its reserve, or
    None if none can (activations and floor do not depend on N).

    In closed form: at stage 3 a rank holds bytes_per_param x ceil(Ψ/N) bytes of states
    (memory.model_state_bytes), which fit in `room` exactly when ceil(Ψ/N) <= m, the whole
    parameters the room holds, that is when N >= ceil(Ψ/m). (Stepping N up one rank at a
    time from an estimate took 50 s for 1e7 parameters when the room held only a few.)
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


def _per_bucket(row: dict) -> int:
    """Collectives per bucket: HSDP adds the all-reduce across the groups to stage 3's."""
    return COLLECTIVES_PER_BUCKET[row["stage"]] + (1 if row.get("mesh") else 0)


def _why_not(other: dict, chosen: dict) -> str:
    """Why `other`, tied in time with `chosen`, lost the tie-break, in words."""
    s = _label(other)
    if other["volume_psi"] > chosen["volume_psi"]:
        return f"{s} sends {other['volume_psi']:g}Ψ"
    per_bucket = other["collectives"] / (chosen["collectives"] / _per_bucket(chosen))
    if other["collectives"] > chosen["collectives"]:
        return f"{s} makes {per_bucket:g} collectives per bucket"
    return (f"{s} holds {_gib(chosen['headroom_bytes'] - other['headroom_bytes'])} "
            f"more")


def _hybrid_words(row: dict, rows: list[dict]) -> str:
    """Stage 3 chosen on several nodes: HSDP against flat stage 3, in words."""
    flat = next(r for r in rows if r["stage"] == 3 and r["mesh"] is None)
    hsdp = next((r for r in rows if r["mesh"]), None)
    if hsdp is None:
        return ""
    if row is hsdp:
        return (f"; its all-gathers stay inside a node: {hsdp['network_bytes'] / 1e9:.3g} GB a "
                f"step over the network per GPU, where flat stage 3 sends "
                f"{flat['network_bytes'] / 1e9:.3g} GB")
    if not hsdp["fits_memory"]:
        return (f"; {_label(hsdp)} would need {_gib(hsdp['per_rank_bytes'])} (its states "
                f"sharded over one node's {hsdp['mesh'][1]} GPUs)")
    return ""


def recommend(n_params: float, gpu_bytes: float, world_size: int, link, compute_s: float,
              precision: str = "mixed", optimizer: str = "adam",
              activation_bytes: float = 0, max_step_s: float | None = None, *,
              buckets: int = DEFAULT_BUCKETS, overlap: float = DEFAULT_OVERLAP,
              gather_after_step: bool = False, reserve_fraction: float = RESERVE_FRACTION,
              activations_checkpointed: bool = False, stages=STAGES,
              hybrid: bool = True) -> Recommendation:
    """The stage to use, with the numbers (`candidates`) and the reason in words.

    1. A stage fits if one rank's states + activations + peak floor leave the reserve
       (reserve_fraction of the GPU) free, and meets max_step_s if given.
    2. Stage 3 on several nodes of a Machine runs as HSDP (`hybrid`, `hybrid_mesh`) when
       that fits and is no slower: its all-gathers stay inside the node, and it sends a
       third less over the network than flat stage 3 (the all-reduce of each rank's 1/S
       slice of the gradients, where flat stage 3 also all-gathers across nodes twice).
    3. Of those, every stage whose projected step is within TIE (5%) of the fastest ties:
       the projection cannot tell them apart.
    4. Ties go to less communication (the paper's volume: 2Ψ before 3Ψ; then fewer
       collectives per step: stage 0's one all-reduce per bucket before a reduce-scatter
       and an all-gather the next forward waits for), then to more headroom.
    So: stage 0 while the model fits replicated, stage 2 when it does not (it ties stage 1
    and holds less, and sends over the network what HSDP sends, with a pass less inside the
    node), stage 3 when only it fits, as HSDP if a node holds its states. `stages` is the
    menu (e.g. (0, 3): what FSDP2 offers, DDP and fully_shard); it must include 3. If no
    stage fits in memory: stage 3 with fits=False and what would fit; if some fit but none
    is fast enough, the fastest that fits.
    """
    rows = candidates(n_params, gpu_bytes, world_size, link, compute_s, precision, optimizer,
                      activation_bytes, max_step_s, buckets=buckets, overlap=overlap,
                      gather_after_step=gather_after_step, reserve_fraction=reserve_fraction,
                      stages=stages, hybrid=hybrid)
    fitting = [r for r in rows if r["fits_memory"]]
    ok = [r for r in fitting if r["meets_time"]]
    hsdp = [r for r in ok if r["mesh"]]
    if hsdp:  # rule 2: stage 3 runs as HSDP, unless flat stage 3 were faster
        ok = [r for r in ok if not (r["stage"] == 3 and r["mesh"] is None
                                    and hsdp[0]["step_s"] <= r["step_s"] * (1 + TIE))]
    flat3 = next(r for r in rows if r["stage"] == 3 and r["mesh"] is None)
    reserve = f"{_gib(rows[0]['reserve_bytes'])} reserve"
    if ok:
        fastest = min(r["step_s"] for r in ok)
        tied = [r for r in ok if r["step_s"] <= fastest * (1 + TIE)]
        row = min(tied, key=lambda r: (r["volume_psi"], r["collectives"], -r["headroom_bytes"]))
        reason = (f"{_label(row)}: {_memory_words(row)} leave "
                  f"{_gib(row['headroom_bytes'])} of {_gib(gpu_bytes)} free (>= {reserve}), "
                  f"projected step {row['step_s']:.3g} s ({row['comm_share']:.1%} waiting on "
                  f"communication)")
        others = [_why_not(r, row) for r in tied if r is not row]
        if others:
            reason += "; ties within 5% with " + ", ".join(others)
        lower = [r for r in rows if r["mesh"] is None and r["stage"] < row["stage"]
                 and not r["fits_memory"]]
        if lower:
            reason += f"; stage {lower[-1]['stage']} needs {_gib(lower[-1]['per_rank_bytes'])}"
        if row["stage"] == 3:
            reason += _hybrid_words(row, rows)
        slow = [r for r in fitting if not r["meets_time"]]
        if slow:
            reason += (f"; {_label(slow[0])} fits but projects {slow[0]['step_s']:.3g} s "
                       f"per step, over max_step_s {max_step_s:g} s")
    elif fitting:
        row = min(fitting, key=lambda r: r["step_s"])
        reason = (f"{_label(row)} fits in memory ({_gib(row['per_rank_bytes'])} of "
                  f"{_gib(gpu_bytes)}) but its projected step {row['step_s']:.3g} s is over "
                  f"max_step_s {max_step_s:g} s, the fastest of the stages that fit; a faster "
                  f"link or fewer, larger buckets would cut the communication")
    else:
        row = flat3
        reason = (f"nothing fits: stage 3 needs {_gib(row['per_rank_bytes'])} per rank "
                  f"({_memory_words(row)}) and the {reserve}, on {_gib(gpu_bytes)}")
        ranks = _ranks_for_stage3(n_params, gpu_bytes, world_size, link, rows, precision,
                                  optimizer, reserve_fraction)
        shrink = ("a smaller micro-batch" if activations_checkpointed else
                  "activation checkpointing or a smaller micro-batch")
        if ranks is None:
            reason += f"; the activations alone do not fit: {shrink}"
        else:
            reason += (f"; stage 3 fits on {ranks} ranks, or offload the optimizer states "
                       f"to CPU (ZeRO-Offload), or {shrink}")
    return Recommendation(stage=row["stage"], fits=bool(ok), headroom_bytes=row["headroom_bytes"],
                          per_rank_bytes=row["per_rank_bytes"], step_s=row["step_s"],
                          comm_share=row["comm_share"], reason=reason, mesh=row["mesh"])
