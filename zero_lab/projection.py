"""Projections beyond this machine: step time and stage choice on links we do not have.

The course measures ZeRO on a few CPU ranks over gloo; this module asks what the same
collectives would cost on real interconnects, with the alpha-beta model of
`collectives/cost_model.py` and published link figures (`LINKS`), or with this machine's own
fit (`link_from_fit`). Every number it returns is a *projection*: a ring algorithm on equal
links, ideal buckets, and the overlap rules stated in `project_step`. One ring runs at one
link's speed: a 64-GPU ring on "nvlink4" is an NVLink-switch domain (NVL72-class); across
DGX nodes the ring's slowest hop, InfiniBand, sets the pace. Use it to reason about
direction and scale (is stage 2 nearly free here? does stage 3 pay off on this link?),
never as a measurement.

    collective_time   one ring collective: steps x alpha + bytes sent x beta
    project_step      one training step per stage: communication, exposed part, share
    candidates        stages 0-3 evaluated side by side (memory + time), for a decision table
    recommend         the lowest stage that fits in memory (and meets a step-time budget)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

from zero_lab import memory
from zero_lab.collectives.cost_model import (
    RING_OPS,
    AlphaBetaModel,
    ring_bytes_sent,
    ring_steps,
)

STAGES = (0, 1, 2, 3)
GiB = 2**30

# One pass over the parameters is split into this many collectives by default: about one per
# transformer layer of a 7B model (32 layers), the unit FSDP wraps. DDP's 25 MB buckets would
# mean ~560 collectives for the same model, and a latency term ~17x larger.
DEFAULT_BUCKETS = 32
# Ideal overlap: all hideable communication runs under compute (a lower bound on step time).
DEFAULT_OVERLAP = 1.0
FORWARD_SHARE = 1 / 3  # backward costs about twice the forward's FLOPs (Kaplan et al. 2020)


# ------------------------------------------------------------------------ validation


def _number(name: str, value, *, minimum: float = 0.0, strict: bool = True, top=None):
    """`value` if it is a finite real (not a bool) > minimum (>= if not strict), <= top."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > minimum if strict else value >= minimum) and (top is None or value <= top)
    if not ok:
        bound = f"{'>' if strict else '>='} {minimum:g}"
        bound += "" if top is None else f" and <= {top:g}"
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}")
    return value


def _integer(name: str, value, minimum: int = 1) -> int:
    """`value` as an int >= minimum; bools and floats are refused (ranks, buckets)."""
    if not isinstance(value, Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return int(value)


def _stage(stage) -> int:
    if not isinstance(stage, Integral) or isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be one of 0, 1, 2, 3; got {stage!r}")
    return int(stage)


# ------------------------------------------------------------------------------ links


@dataclass(frozen=True)
class Link:
    """A link class in the alpha-beta model: t = steps x alpha + bytes sent x beta.

    `alpha`: seconds of latency per ring step. `beta`: seconds per byte one rank sends, i.e.
    1 / bandwidth per direction. (cost_model's `AlphaBeta.beta` is the bandwidth itself, in
    bytes/s; `link_from_fit` converts.) `source`: where the numbers come from.
    """

    name: str
    alpha: float
    beta: float
    source: str

    def __post_init__(self):
        _number("alpha", self.alpha, strict=False)
        _number("beta", self.beta)

    @property
    def bandwidth(self) -> float:
        """Bytes per second per direction, 1 / beta."""
        return 1.0 / self.beta


# alpha: NCCL's own latency model, the per-step hardware latency of a ring with the Simple
# protocol (the one large messages use): hwLat[...][RING][SIMPLE] in NVIDIA/nccl
# src/graph/tuning.cc is 3.4 us on NVLink, 5.7 us on PCI, 14 us on the network (NCCL adds a
# base latency of 8.4 us per call, left out here). Bandwidths are published nominal figures.
_NOMINAL = "Published nominal figures, not measurements; alpha: NCCL tuning.cc hwLat ring/Simple"
LINKS: dict[str, Link] = {
    "pcie4": Link("pcie4", 5.7e-6, 1 / 25e9, "PCIe 4.0 x16 (PCI-SIG): 16 GT/s x 16 lanes, "
                  "128b/130b = 31.5 GB/s per direction, ~25 GB/s after packet overhead, about "
                  f"what nccl-tests busbw reaches over PCIe. {_NOMINAL}, PCI (5.7 us)."),
    "nvlink3": Link("nvlink3", 3.4e-6, 1 / 230e9, "A100 SXM datasheet: NVLink 3, 600 GB/s "
                    "bidirectional = 300 GB/s per direction; nccl-tests all_reduce busbw on "
                    f"8x A100 is typically ~230 GB/s. {_NOMINAL}, NVLink (3.4 us)."),
    "nvlink4": Link("nvlink4", 3.4e-6, 1 / 370e9, "H100 SXM datasheet: NVLink 4, 900 GB/s "
                    "bidirectional = 450 GB/s per direction; nccl-tests ring all_reduce busbw "
                    f"on 8x H100 is typically ~360-400 GB/s. {_NOMINAL}, NVLink (3.4 us)."),
    "infiniband_ndr": Link("infiniband_ndr", 14e-6, 1 / 50e9, "InfiniBand NDR: 400 Gb/s = "
                           "50 GB/s per port per direction, one port per GPU (DGX H100); line "
                           "rate, nccl-tests reach ~90% of it. "
                           f"{_NOMINAL}, network (14 us)."),
    "ethernet_100g": Link("ethernet_100g", 14e-6, 1 / 12.5e9, "100 GbE: 12.5 GB/s per "
                          "direction, line rate. "
                          f"{_NOMINAL}, network (14 us; RoCE-class, TCP is slower)."),
}


def get_link(link: str | Link) -> Link:
    """`link` itself if it is a Link, else the entry of `LINKS` it names."""
    if isinstance(link, Link):
        return link
    if isinstance(link, str) and link in LINKS:
        return LINKS[link]
    raise ValueError(f"link must be a Link or one of {', '.join(map(repr, LINKS))}; "
                     f"got {link!r}")


def link_from_fit(model: AlphaBetaModel, op: str = "all_reduce", name: str | None = None) -> Link:
    """A Link from a measured alpha-beta fit (`cost_model.fit_alpha_beta`, notebook 02).

    Uses the fit of `op` when it was measured, else the pooled fit (as `model.predict`
    does); op="pooled" asks for the pooled fit. The fit's alpha is already per ring step.
    """
    if not isinstance(model, AlphaBetaModel):
        raise ValueError(f"model must be an AlphaBetaModel (fit_alpha_beta); got {model!r}")
    if op != "pooled" and op not in RING_OPS:
        raise ValueError(f"op must be 'pooled' or one of {', '.join(RING_OPS)}; got {op!r}")
    used = op if op in model.per_op else "pooled"
    fit = model.per_op.get(op, model.pooled)
    source = (f"measured: alpha-beta fit of {used} on this machine "
              f"(alpha {fit.alpha * 1e6:.1f} us/step, {fit.beta / 1e9:.2f} GB/s)")
    return Link(name or f"fit:{used}", fit.alpha, 1.0 / fit.beta, source)


# ------------------------------------------------------------------------ collectives


def collective_time(op: str, nbytes: float, world_size: int, link: str | Link) -> float:
    """Seconds one ring collective takes on `link` (the alpha-beta model).

        t = ring_steps(op, N) x alpha + ring_bytes_sent(op, nbytes, N) x beta

    ring_steps: 2(N-1) for all-reduce, N-1 for reduce-scatter, all-gather and broadcast.
    ring_bytes_sent: 2(N-1)/N x nbytes for all-reduce, (N-1)/N x nbytes for reduce-scatter
    and all-gather, nbytes for broadcast. `nbytes` is the full message, as in cost_model
    (the full input of a reduce-scatter, the full output of an all-gather). N = 1 costs 0.
    """
    if op not in RING_OPS:
        raise ValueError(f"op must be one of {', '.join(RING_OPS)}; got {op!r}")
    _number("nbytes", nbytes)
    n = _integer("world_size", world_size)
    lk = get_link(link)
    return ring_steps(op, n) * lk.alpha + ring_bytes_sent(op, nbytes, n) * lk.beta


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


def project_step(n_params: float, stage: int, world_size: int, link: str | Link,
                 compute_s: float, bytes_per_elem: int = 2, buckets: int = DEFAULT_BUCKETS,
                 overlap: float = DEFAULT_OVERLAP, gather_overlap: bool = False) -> dict:
    """One data-parallel training step at ZeRO `stage`, projected on `link`.

    Collectives (each pass over the Ψ parameters split into `buckets` equal collectives of
    Ψ x bytes_per_elem / buckets bytes, timed with `collective_time`):
      stage 0     all-reduce of the gradients                        (volume 2Ψ)
      stage 1, 2  reduce-scatter of the gradients, then an all-gather of the updated
                  parameters after the optimizer step                (Ψ + Ψ = 2Ψ)
      stage 3     per unit: all-gather in forward, all-gather in backward, reduce-scatter
                  of its gradients                                   (3Ψ)
    Stages 1 and 2 send the same collectives; they differ in memory only.

    Time and overlap (`compute_s` = forward + backward of one rank's batch, measured or
    `compute_time`; weak scaling: the per-rank batch, so compute_s, is fixed as N grows):
      - forward = compute_s / 3, backward = 2 compute_s / 3; the optimizer step is left out.
      - gradient collectives run under backward, except the last bucket's (it starts
        when backward ends): hidden = min(overlap x (rest), backward).
      - stages 1-2: the parameter all-gather follows the optimizer step with nothing left
        to compute, so all of it is exposed (this course's stages, DeepSpeed ZeRO-1/2);
        `gather_overlap=True` instead runs it under the next forward, first bucket exposed
        (FSDP SHARD_GRAD_OP-style prefetch).
      - stage 3, with prefetch: forward all-gathers hide under forward except the first
        unit's; backward all-gathers and reduce-scatters hide under backward except the
        first unit's gather and the last unit's reduce-scatter (same min rule).
      - collectives share the link one at a time: their times add.
    `overlap` in [0, 1] is the fraction of the overlappable communication that really
    overlaps (1: ideal, a lower bound on step time; 0: none).

    Returns {"stage", "world_size", "link", "compute_s", "comm_s" (seconds per collective
    kind), "comm_total_s", "bytes_sent" (per rank, ring), "exposed_s", "step_s"
    (compute_s + exposed_s), "comm_share" (exposed_s / step_s)}.
    """
    _number("n_params", n_params)
    stage = _stage(stage)
    n = _integer("world_size", world_size)
    lk = get_link(link)
    _number("compute_s", compute_s)
    _number("bytes_per_elem", bytes_per_elem)
    k = _integer("buckets", buckets)
    _number("overlap", overlap, strict=False, top=1.0)
    if not isinstance(gather_overlap, bool):
        raise ValueError(f"gather_overlap must be True or False; got {gather_overlap!r}")

    bucket = n_params * bytes_per_elem / k  # one collective's full message
    one = {op: collective_time(op, bucket, n, lk) for op in RING_OPS}
    gather, scatter, reduce = one["all_gather"], one["reduce_scatter"], one["all_reduce"]
    forward, backward = compute_s * FORWARD_SHARE, compute_s * (1 - FORWARD_SHARE)
    # phases: (seconds of communication, seconds of it that can never hide, compute under it)
    if stage == 0:
        calls = {"all_reduce": k}
        phases = [(k * reduce, reduce, backward)]
    elif stage in (1, 2):
        calls = {"reduce_scatter": k, "all_gather": k}
        after_step = (k * gather, k * gather, 0.0)  # all of it exposed
        params = (k * gather, gather, forward) if gather_overlap else after_step
        phases = [(k * scatter, scatter, backward), params]
    else:
        calls = {"all_gather": 2 * k, "reduce_scatter": k}
        phases = [(k * gather, gather, forward),
                  (k * (gather + scatter), gather + scatter, backward)]
    exposed = sum(total - min(overlap * (total - always), under)
                  for total, always, under in phases)
    comm = {op: count * one[op] for op, count in calls.items()}
    sent = sum(count * ring_bytes_sent(op, bucket, n) for op, count in calls.items())
    step = compute_s + exposed
    return {
        "stage": stage, "world_size": n, "link": lk.name, "compute_s": compute_s,
        "comm_s": comm, "comm_total_s": sum(comm.values()), "bytes_sent": sent,
        "exposed_s": exposed, "step_s": step, "comm_share": exposed / step,
    }


# ------------------------------------------------------------------ choosing a stage


@dataclass(frozen=True)
class Recommendation:
    """The stage `recommend` chose, and why, in words with the numbers."""

    stage: int
    fits: bool  # the stage meets every constraint (memory, and max_step_s if given)
    headroom_bytes: float  # gpu_bytes - per_rank_bytes (negative: over by that much)
    per_rank_bytes: float  # model states + activations on one rank
    step_s: float
    comm_share: float
    reason: str


def candidates(n_params: float, gpu_bytes: float, world_size: int, link: str | Link,
               compute_s: float, precision: str = "mixed", optimizer: str = "adam",
               activation_bytes: float = 0, max_step_s: float | None = None, *,
               buckets: int = DEFAULT_BUCKETS, overlap: float = DEFAULT_OVERLAP,
               gather_overlap: bool = False) -> list[dict]:
    """Stages 0-3 evaluated side by side, one dict each, for a decision table.

    Keys: stage, model_state_bytes (`memory.model_state_bytes`, per rank), activation_bytes,
    per_rank_bytes (their sum), headroom_bytes (gpu_bytes - per_rank_bytes), fits_memory,
    step_s, comm_share (from `project_step`, communicating in the working precision), and
    meets_time (step_s <= max_step_s, True when no budget is given).
    """
    _number("gpu_bytes", gpu_bytes)
    _number("activation_bytes", activation_bytes, strict=False)
    if max_step_s is not None:
        _number("max_step_s", max_step_s)
    elem = memory.bytes_per_param(precision, optimizer)["params"]  # what grads are sent in
    rows = []
    for stage in STAGES:
        states = memory.model_state_bytes(n_params, stage, world_size, precision, optimizer)
        step = project_step(n_params, stage, world_size, link, compute_s, elem, buckets,
                            overlap, gather_overlap)
        total = states["total"] + activation_bytes
        rows.append({
            "stage": stage, "model_state_bytes": states["total"],
            "activation_bytes": activation_bytes, "per_rank_bytes": total,
            "headroom_bytes": gpu_bytes - total, "fits_memory": total <= gpu_bytes,
            "step_s": step["step_s"], "comm_share": step["comm_share"],
            "meets_time": max_step_s is None or step["step_s"] <= max_step_s,
        })
    return rows


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def _memory_words(row: dict) -> str:
    words = f"model states {_gib(row['model_state_bytes'])}"
    if row["activation_bytes"]:
        words += f" + activations {_gib(row['activation_bytes'])}"
    return words


def _ranks_for_stage3(n_params, gpu_bytes, world_size, precision, optimizer, activations):
    """Fewest ranks at which stage 3's states + activations fit, or None if none can."""
    room = gpu_bytes - activations
    per_param = memory.bytes_per_param(precision, optimizer)["total"]
    if room < per_param:  # not even one parameter per rank would fit
        return None
    n = max(world_size + 1, math.ceil(per_param * n_params / room))
    while memory.model_state_bytes(n_params, 3, n, precision, optimizer)["total"] > room:
        n += 1  # ceil(Ψ/N) partitions: at most a few steps past the estimate
    return n if n <= n_params else None


def recommend(n_params: float, gpu_bytes: float, world_size: int, link: str | Link,
              compute_s: float, precision: str = "mixed", optimizer: str = "adam",
              activation_bytes: float = 0, max_step_s: float | None = None, *,
              buckets: int = DEFAULT_BUCKETS, overlap: float = DEFAULT_OVERLAP,
              gather_overlap: bool = False) -> Recommendation:
    """The lowest ZeRO stage whose per-rank bytes fit in `gpu_bytes` and, if `max_step_s`
    is given, whose projected step takes no longer; see `candidates` for the numbers.

    Lower stages are preferred: they send no more bytes than higher ones and lean less on
    overlap (stage 3 hides its gathers only with prefetch). If no stage fits in memory,
    the answer is stage 3 with fits=False and a reason naming what would fit (more ranks,
    offloading, activation checkpointing); if some fit but none is fast enough, the
    fastest that fits, with fits=False.
    """
    rows = candidates(n_params, gpu_bytes, world_size, link, compute_s, precision, optimizer,
                      activation_bytes, max_step_s, buckets=buckets, overlap=overlap,
                      gather_overlap=gather_overlap)
    fitting = [r for r in rows if r["fits_memory"]]
    ok = [r for r in fitting if r["meets_time"]]
    if ok:
        row = ok[0]
        reason = (f"stage {row['stage']}: {_memory_words(row)} fit in "
                  f"{_gib(gpu_bytes)} with {_gib(row['headroom_bytes'])} to spare, "
                  f"projected step {row['step_s']:.3g} s ({row['comm_share']:.1%} of it "
                  f"waiting on communication)")
        lower = rows[:row["stage"]]
        if lower and not lower[-1]["fits_memory"]:
            reason += f"; stage {lower[-1]['stage']} needs {_gib(lower[-1]['per_rank_bytes'])}"
        slow = [r for r in lower if r["fits_memory"]]
        if slow:
            reason += (f"; stage {slow[-1]['stage']} fits but projects {slow[-1]['step_s']:.3g} s "
                       f"per step, over max_step_s {max_step_s:g} s")
        if row["stage"] == 1:  # the seed blog's point: stage 2 costs the same time
            reason += (f"; stage 2 projects the same step time with "
                       f"{_gib(rows[2]['headroom_bytes'])} to spare")
    elif fitting:
        row = min(fitting, key=lambda r: r["step_s"])
        reason = (f"stage {row['stage']} fits in memory ({_gib(row['per_rank_bytes'])} of "
                  f"{_gib(gpu_bytes)}) but its projected step {row['step_s']:.3g} s is over "
                  f"max_step_s {max_step_s:g} s, the fastest of the stages that fit; a faster "
                  f"link or fewer, larger buckets would cut the communication")
    else:
        row = rows[3]
        reason = (f"nothing fits: stage 3 needs {_gib(row['per_rank_bytes'])} per rank "
                  f"({_memory_words(row)}) but the GPU has {_gib(gpu_bytes)}")
        ranks = _ranks_for_stage3(n_params, gpu_bytes, world_size, precision, optimizer,
                                  activation_bytes)
        if ranks is None:
            reason += ("; the activations alone do not fit: shrink the per-rank batch or "
                       "checkpoint activations")
        else:
            reason += (f"; stage 3 would fit on {ranks} ranks, or offload the optimizer "
                       f"states to CPU (ZeRO-Offload) or checkpoint activations")
    return Recommendation(stage=row["stage"], fits=bool(ok), headroom_bytes=row["headroom_bytes"],
                          per_rank_bytes=row["per_rank_bytes"], step_s=row["step_s"],
                          comm_share=row["comm_share"], reason=reason)
