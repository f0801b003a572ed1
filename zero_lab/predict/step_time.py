"""One training step projected on machines we do not have: its collectives priced, its
exposed communication under one overlap rule for every stage.

The alpha-beta model of `links`, applied to a whole step: which collectives each stage
issues per bucket (unit), what each costs on a Link, a Machine of nodes or this machine's
fitted OpLinks, and how much of it hides under the compute of forward and backward. Stage 3
can also run as hybrid sharding (HSDP, `replicas=R`): sharded inside groups of N/R ranks,
its gradient slices all-reduced across the groups (stages/hybrid.py builds it for real).

    compute_time      forward + backward seconds from 6Ψ FLOPs a token
    optimizer_time    one rank's Adam update: the elements it owns, memory-bound
    oversubscribed    one rank's compute when N single-threaded ranks share fewer cores
    project_step      one training step per stage: communication, its latency and bandwidth
                      terms, the bytes that cross the network, the exposed part, the step

`projection` builds the choice of a stage on it and re-exports these names.
"""

from __future__ import annotations

from numbers import Integral

from zero_lab.collectives.volume import ring_bytes_sent, ring_steps, zero_volume
from zero_lab.predict.knobs import accumulation_messages
from zero_lab.predict.links import (
    Machine,
    OpLinks,
    checked_integer,
    checked_number,
    collective_terms,
    collective_time,
    get_link,
)

STAGES = (0, 1, 2, 3)

# One pass over the parameters is split into this many collectives by default: about one per
# transformer layer of a 7B model (32 layers), the unit FSDP wraps. DDP's 25 MB buckets would
# mean ~560 collectives for the same model, and a latency term ~17x larger.
DEFAULT_BUCKETS = 32
# Ideal overlap: all hideable communication runs under compute (a lower bound on step time).
DEFAULT_OVERLAP = 1.0
FORWARD_SHARE = 1 / 3  # backward costs about twice the forward's FLOPs (Kaplan et al. 2020)
# Adam's update is memory-bound: per element it owns, a rank reads the gradient (2 bytes in
# bf16 or 4 in fp32), reads and writes the fp32 master weight, m and v (24), and writes the
# 16-bit working copy (2, mixed precision only): 28 bytes either way.
ADAM_BYTES_PER_ELEM = 28


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
    checked_number("n_params", n_params)
    checked_number("tokens", tokens)
    checked_number("flops_per_s", flops_per_s)
    return 6.0 * n_params * tokens / flops_per_s


def optimizer_time(n_params: float, stage: int, world_size: int, bytes_per_s: float) -> float:
    """Seconds of one rank's Adam step: the elements it updates (Ψ at stage 0, Ψ/N at stages
    1-3) x ADAM_BYTES_PER_ELEM / the memory bandwidth achieved (an H100's 3.35 TB/s HBM3 at
    ~60% gives about 2e12)."""
    checked_number("n_params", n_params)
    n = checked_integer("world_size", world_size)
    checked_number("bytes_per_s", bytes_per_s)
    owned = n_params if _stage(stage) == 0 else n_params / n
    return owned * ADAM_BYTES_PER_ELEM / bytes_per_s


def oversubscribed(compute_s: float, world_size: int, cores: int) -> float:
    """One rank's compute when `world_size` single-threaded ranks share `cores` cores: each
    gets cores/N of a core once N > cores, so its compute stretches by N/cores."""
    checked_number("compute_s", compute_s)
    n, c = checked_integer("world_size", world_size), checked_integer("cores", cores)
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
                 replicas: int = 1, optimizer_s: float = 0.0,
                 overlap_step: bool = False, control: int = 0, accumulation: int = 1,
                 grad_accumulation: str = "sharded") -> dict:
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
    `control` small blocking collectives a step carry no data: this course's lockstep check
    (`shard(..., check_lockstep=True)`, stages/lockstep.py) is one all-gather of 24 bytes a
    rank, sent by torch's collective (on an OpLinks, priced on its all-reduce's ring link).
    Each costs its latency and nothing hides it (the step waits for the answer).
    `optimizer_s` is the optimizer step's time (`optimizer_time`), added to the step; nothing
    hides under it, unless `overlap_step=True` (stages 1-2, shard()'s option of that name):
    each bucket is stepped as its gradient slice lands, so the last reduction, which nothing
    in backward hides, runs under the other k - 1 buckets' steps (at most (k-1)/k of
    `optimizer_s`, times `overlap`).
    `gather_after_step=True` describes implementations that all-gather the parameters after
    the optimizer step instead (this course's stages 1-2 by default, DeepSpeed
    ZeRO-1/2): nothing computes then, so by the same rule none of that gather hides.
    `accumulation=k` micro-batches per optimizer step (`compute_s` is one micro-batch's): the
    first k - 1 under no_sync, each op's passes over Ψ from `knobs.accumulation_messages`,
    the formulas notebook 08 measures. Stages 0-1 reduce in the last backward only; stage 2
    (DeepSpeed's ZeRO-2) and stage 3 with `grad_accumulation="sharded"` in every one, each
    under its own backward; stage 3 gathers every unit in each forward and backward.
    `replicas=R` > 1 (stage 3 only): hybrid sharding (HSDP, stages/hybrid.py) on R groups of
    S = N/R ranks. Its all-gathers and reduce-scatters run on the S ranks of a group (on a
    Machine, S must be whole nodes: with S = node_size they never leave NVLink); each
    reduce-scatter is followed by an all-reduce of its 1/S slice across the R groups
    (`_across_terms`), in backward, under the same rule.

    Returns {"stage", "world_size", "link", "compute_s", "optimizer_s", "comm_s" (per kind),
    "comm_total_s", "latency_s" and "bandwidth_s" (comm_total_s's two terms),
    "bytes_sent" (per rank), "volume_psi" (the ZeRO paper's volume, in Ψ: 2, 2, 2, 3),
    "collectives" (per step), "calls" (per step, by kind), "control_s" (the control
    collectives, in exposed_s), "exposed_s", "step_s" (accumulation x compute_s + optimizer_s
    + exposed_s), "accumulation", "comm_share", "network_bytes" (what one GPU sends over a
    Machine's network per step; 0 inside one node or on a Link), "replicas"}.
    """
    checked_number("n_params", n_params)
    stage = _stage(stage)
    n = checked_integer("world_size", world_size)
    lk = get_link(link)
    checked_number("compute_s", compute_s)
    checked_number("bytes_per_elem", bytes_per_elem)
    k = checked_integer("buckets", buckets)
    checked_number("overlap", overlap, strict=False, top=1.0)
    if not isinstance(gather_after_step, bool):
        raise ValueError(f"gather_after_step must be True or False; got {gather_after_step!r}")
    r = checked_integer("replicas", replicas)
    checked_number("optimizer_s", optimizer_s, strict=False)
    checks = checked_integer("control", control, minimum=0)
    micro = checked_integer("accumulation", accumulation)
    if not isinstance(overlap_step, bool) or overlap_step and stage not in (1, 2):
        raise ValueError(f"overlap_step is True or False, and True only at stages 1-2 (as in "
                         f"shard()); got {overlap_step!r} at stage {stage}")
    if r > 1 and (stage != 3 or n % r):
        raise ValueError(f"replicas={r} is hybrid sharding: stage 3 on a world size it divides; "
                         f"got stage {stage}, world_size {n}")
    s = n // r  # the ranks a unit is sharded over

    bucket = n_params * bytes_per_elem / k  # one collective's full message
    # passes over Ψ per optimizer step, op by op: notebook 08's formulas, not a second copy
    passes = {op: int(m["count"]) for op, m in accumulation_messages(
        stage, 1, micro, 2, grad_accumulation=grad_accumulation).items()}
    calls = {op: passes[op] * k for op in _collectives(stage, k)}  # _collectives' at k = 1
    reducing = passes["all_reduce" if stage == 0 else "reduce_scatter"]  # 1 or micro
    terms = {op: collective_terms(op, bucket, s, lk) for op in calls}
    sizes = {op: (bucket, s) for op in calls}  # (message, ranks) of each kind
    if r > 1:  # every gradient slice is then all-reduced across the groups
        terms["all_reduce"] = _across_terms(bucket / s, r, s, lk)
        calls["all_reduce"] = reducing * k
        sizes["all_reduce"] = (bucket / s, r)
    one = {op: t["latency_s"] + t["bandwidth_s"] for op, t in terms.items()}
    forward, backward = compute_s * FORWARD_SHARE, compute_s * (1 - FORWARD_SHARE)
    # phases: (seconds of communication, seconds of it that can never hide, compute under it)
    # with accumulation every micro-batch that reduces (or gathers) is a phase of its own
    if stage == 0:
        phases = [(k * one["all_reduce"], one["all_reduce"], backward)] * reducing
    elif stage in (1, 2):
        gather, scatter = one["all_gather"], one["reduce_scatter"]
        params = (k * gather, k * gather, 0.0) if gather_after_step else (k * gather, gather,
                                                                          forward)
        phases = [params] + [(k * scatter, scatter, backward)] * reducing
    else:
        gather, scatter = one["all_gather"], one["reduce_scatter"] + one.get("all_reduce", 0.0)
        phases = ([(k * gather, gather, forward)] * micro
                  + [(k * gather, gather, backward)] * (micro - reducing)
                  + [(k * (gather + scatter), gather + scatter, backward)] * reducing)
    exposed = sum(total - min(overlap * (total - always), under)
                  for total, always, under in phases)
    if overlap_step:  # the last reduction (exposed above) under the other buckets' steps
        exposed -= min(overlap * one["reduce_scatter"], optimizer_s * (k - 1) / k)
    control_s = checks * _control_time(n, lk)
    exposed += control_s
    comm = {op: count * one[op] for op, count in calls.items()}
    step = micro * compute_s + optimizer_s + exposed
    return {
        "stage": stage, "world_size": n, "link": lk.name, "compute_s": compute_s,
        "optimizer_s": optimizer_s, "control_s": control_s,
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
        "replicas": r, "accumulation": micro,
    }


# What one rank sends in the lockstep check: three int64s (stages/lockstep.py).
CONTROL_BYTES = 24


def _control_time(n: int, link) -> float:
    """One lockstep check: an all-gather of CONTROL_BYTES a rank by torch's collective (on an
    OpLinks, the all-reduce's ring link, not the direct exchange's). One rank costs 0."""
    lk = link.link("all_reduce") if isinstance(link, OpLinks) else link
    return collective_time("all_gather", CONTROL_BYTES * n, n, lk)


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
