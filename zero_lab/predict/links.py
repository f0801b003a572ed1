"""What one collective costs on links we do not have: link classes, nodes of GPUs, alpha-beta.

A `Link` is one class of link in the alpha-beta model: t = steps x alpha + bytes sent x beta.
NVLink and PCIe join the GPUs of one node and no more (`domain` = 8 ranks); a network link
(InfiniBand, Ethernet) joins any number. A `Machine` is what a cluster really is: nodes of
`node_size` GPUs on an intra-node link, joined by a network with `nics_per_node` ports per
node. Across nodes NCCL sends an all-gather or a reduce-scatter as ONE flat ring through all
N GPUs (its tree algorithms are all-reduce only; PAT covers one GPU per node): N-1 steps, of
which m-1 cross the network (m nodes), as NCCL's own tuning model counts them. The bytes each
rank sends are the ring's, (N-1)/N of the message, the network's share through the node's
NICs. An all-reduce is priced as a hierarchical reduce-scatter + all-gather ((g-1) NVLink and
(m-1) network steps each), between NCCL's tree (log2 m network steps) and its flat ring.

A collective need not be a ring. On gloo the stages send their reduce-scatters and
all-gathers as the direct exchange (`collectives/exchange.py`): every message posted at once,
ONE round whatever N is, the same (N-1)/N of the bytes. A Link says which it prices
(`algorithm`: "ring" or "exchange"), and `OpLinks` gives each collective its own Link: what a
machine whose collectives travel by different transports really is (here: gloo's ring
all-reduce for stage 0, the exchange for stages 1-3).

    collective_terms  one collective's latency and bandwidth terms, apart
    collective_time   their sum
    latency_steps     the alpha latencies one collective pays: a ring's N-1 (all-reduce
                      2(N-1)), the exchange's one round
    get_link          a Link or Machine by name (LINKS, MACHINES)
    link_from_fit     this machine's Link, from notebook 02's alpha-beta fit
    fit_op_links      this machine's OpLinks: each op swept fitted alone, by its transport

The published links and machines are projections from published figures; the fitted ones
are this machine's measurements, and describe this machine only.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from numbers import Integral, Real

from zero_lab.collectives.timing import AlphaBetaModel, fit_alpha_beta_points
from zero_lab.collectives.volume import RING_OPS, ring_bytes_sent, ring_steps

ALGORITHMS = ("ring", "exchange")
EXCHANGE_OPS = ("reduce_scatter", "all_gather")  # what the direct exchange implements


def _too_large(name: str, value) -> None:
    """Refuse an int no float can hold (10**400): the projection computes in floats, where
    it would raise OverflowError far from the argument that caused it."""
    if isinstance(value, Integral) and not isinstance(value, bool) and \
            abs(value) > sys.float_info.max:
        raise ValueError(f"{name} is too large for a float: an int of {value.bit_length()} "
                         f"bits, where a float holds less than 2**1024")


def checked_number(name: str, value, *, minimum: float = 0.0, strict: bool = True, top=None):
    """`value` if it is a finite real (not a bool) > minimum (>= if not strict), <= top."""
    _too_large(name, value)
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > minimum if strict else value >= minimum) and (top is None or value <= top)
    if not ok:
        bound = f"{'>' if strict else '>='} {minimum:g}"
        bound += "" if top is None else f" and <= {top:g}"
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}")
    return value


def checked_integer(name: str, value, minimum: int = 1) -> int:
    """`value` as an int >= minimum; bools and floats are refused (ranks, buckets)."""
    _too_large(name, value)
    if not isinstance(value, Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return int(value)


def latency_steps(op: str, world_size: int, algorithm: str = "ring") -> int:
    """The alpha latencies one collective of `op` pays on N ranks, one after another.

    "ring": `ring_steps`, N-1 (an all-reduce 2(N-1)): each step waits for the last.
    "exchange": 1. The direct exchange posts all its N-1 messages at once and waits for them
    together: one round, whatever N is (and nothing on one rank). It implements only the
    reduce-scatter and the all-gather.
    """
    if algorithm == "ring":
        return ring_steps(op, world_size)
    if algorithm != "exchange":
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    if op not in EXCHANGE_OPS:
        raise ValueError(f"the direct exchange sends {' and '.join(EXCHANGE_OPS)}, not {op!r}")
    return 0 if world_size == 1 else 1


@dataclass(frozen=True)
class Link:
    """One link class: `alpha` seconds of latency per step, `beta` seconds per byte one
    rank sends (1 / bandwidth per direction; timing's `AlphaBeta.beta` is the bandwidth
    itself, `link_from_fit` converts). `domain`: the most ranks it can join (the GPUs of one
    node for NVLink and PCIe), None for a network. `source`: where the numbers come from.
    `algorithm`: how a collective crosses it, so how many alphas it pays (`latency_steps`):
    "ring" (every published link), or "exchange" (the direct exchange, one round)."""

    name: str
    alpha: float
    beta: float
    source: str
    domain: int | None = None
    algorithm: str = "ring"

    def __post_init__(self):
        checked_number("alpha", self.alpha, strict=False)
        checked_number("beta", self.beta)
        if self.domain is not None:
            checked_integer("domain", self.domain, minimum=2)
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; "
                             f"got {self.algorithm!r}")

    @property
    def bandwidth(self) -> float:
        """Bytes per second per direction, 1 / beta."""
        return 1.0 / self.beta


@dataclass(frozen=True)
class Machine:
    """Nodes of `node_size` GPUs on the `intra` link, joined by the `inter` network, which
    has `nics_per_node` ports per node (DGX H100: 8, one per GPU)."""

    name: str
    intra: Link
    inter: Link
    node_size: int
    nics_per_node: int
    source: str = ""

    def __post_init__(self):
        checked_integer("node_size", self.node_size, minimum=2)
        checked_integer("nics_per_node", self.nics_per_node)
        if self.intra.domain is not None and self.intra.domain < self.node_size:
            raise ValueError(f"intra link {self.intra.name} joins at most {self.intra.domain} "
                             f"ranks, fewer than node_size {self.node_size}")
        if self.inter.domain is not None:
            raise ValueError(f"inter must be a network link (domain None); got {self.inter.name}")
        if self.intra.algorithm != "ring" or self.inter.algorithm != "ring":
            raise ValueError("a Machine's collectives run as rings inside and across nodes")


@dataclass(frozen=True)
class OpLinks:
    """A Link per collective: `links[op]` prices `op`. What one machine is when its
    collectives travel by different transports (on gloo: torch's all-reduce, and the
    direct exchange for the stages' reduce-scatters and all-gathers), each fitted alone."""

    name: str
    links: Mapping[str, Link]
    source: str = ""

    def __post_init__(self):
        if not self.links or not all(op in RING_OPS and isinstance(lk, Link)
                                     for op, lk in self.links.items()):
            raise ValueError(f"links must map ops ({', '.join(RING_OPS)}) to Links; "
                             f"got {self.links!r}")

    def link(self, op: str) -> Link:
        """The Link `op` is priced on; an op that was not measured is refused."""
        if op not in self.links:
            raise ValueError(f"{self.name} has no link for {op!r}: it prices "
                             f"{', '.join(self.links)}")
        return self.links[op]


# alpha: NCCL's own latency model, the per-step hardware latency of a ring with the Simple
# protocol (the one large messages use): hwLat[...][RING][SIMPLE] in NVIDIA/nccl
# src/graph/tuning.cc is 3.4 us on NVLink, 5.7 us on PCI, 14 us on the network (NCCL adds a
# base latency of 8.4 us per call, left out here). Bandwidths are published nominal figures.
_NOMINAL = "Published nominal figures, not measurements; alpha: NCCL tuning.cc hwLat ring/Simple"
NODE = 8  # GPUs per node on every intra-node link below (HGX/DGX boards, PCIe servers)
LINKS: dict[str, Link] = {
    "pcie4": Link("pcie4", 5.7e-6, 1 / 25e9, "PCIe 4.0 x16 (PCI-SIG): 16 GT/s x 16 lanes, "
                  "128b/130b = 31.5 GB/s per direction, ~25 GB/s after packet overhead, about "
                  f"what nccl-tests busbw reaches over PCIe. {_NOMINAL}, PCI (5.7 us).", NODE),
    "pcie5": Link("pcie5", 5.7e-6, 1 / 50e9, "PCIe 5.0 x16 (PCI-SIG): 32 GT/s x 16 lanes, "
                  "63 GB/s per direction, ~50 GB/s after packet overhead (the same 80% as "
                  f"Gen4). {_NOMINAL}, PCI (5.7 us).", NODE),
    "nvlink3": Link("nvlink3", 3.4e-6, 1 / 230e9, "A100 SXM datasheet: NVLink 3, 600 GB/s "
                    "bidirectional = 300 GB/s per direction; nccl-tests all_reduce busbw on "
                    f"8x A100 is typically ~230 GB/s. {_NOMINAL}, NVLink (3.4 us).", NODE),
    "nvlink4": Link("nvlink4", 3.4e-6, 1 / 370e9, "H100 SXM datasheet: NVLink 4, 900 GB/s "
                    "bidirectional = 450 GB/s per direction; nccl-tests ring all_reduce busbw "
                    "on 8x H100 is typically ~360-400 GB/s; NCCL's default all-reduce there "
                    "is NVLS (NVLink SHARP, the switch adds): busbw ~480 GB/s (nccl-tests#212), "
                    f"which this ring model does not price. {_NOMINAL}, NVLink (3.4 us).", NODE),
    "infiniband_ndr": Link("infiniband_ndr", 14e-6, 1 / 50e9, "InfiniBand NDR: 400 Gb/s = "
                           "50 GB/s per port per direction; line rate, nccl-tests reach ~90% "
                           f"of it. {_NOMINAL}, network (14 us)."),
    "ethernet_100g": Link("ethernet_100g", 14e-6, 1 / 12.5e9, "100 GbE: 12.5 GB/s per "
                          "direction, line rate. "
                          f"{_NOMINAL}, network (14 us; RoCE-class, TCP is slower)."),
}
MACHINES: dict[str, Machine] = {
    "dgx_h100": Machine("dgx_h100", LINKS["nvlink4"], LINKS["infiniband_ndr"], NODE, 8,
                        "DGX H100: 8 GPUs on NVLink 4 per node, 8 InfiniBand NDR ports per "
                        "node (one per GPU)"),
    "pcie5_server": Machine("pcie5_server", LINKS["pcie5"], LINKS["infiniband_ndr"], NODE, 2,
                            "8 GPUs on PCIe 5.0 per node, 2 InfiniBand NDR ports per node"),
}


def get_link(link: str | Link | Machine | OpLinks) -> Link | Machine | OpLinks:
    """`link` itself if it is a Link, Machine or OpLinks, else the entry of LINKS or MACHINES
    it names."""
    if isinstance(link, (Link, Machine, OpLinks)):
        return link
    if isinstance(link, str) and link in {**LINKS, **MACHINES}:
        return {**LINKS, **MACHINES}[link]
    raise ValueError(f"link must be a Link, a Machine, an OpLinks or one of "
                     f"{', '.join(map(repr, [*LINKS, *MACHINES]))}; got {link!r}")


def link_from_fit(model: AlphaBetaModel, op: str = "all_reduce", name: str | None = None,
                  domain: int | None = None) -> Link:
    """A Link from a measured alpha-beta fit (`collectives.timing.fit_alpha_beta`, notebook 02).

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
    return Link(name or f"fit:{used}", fit.alpha, 1.0 / fit.beta, source, domain)


def fit_link(timings: Iterable[dict], op: str, algorithm: str = "ring", name: str | None = None,
             domain: int | None = None) -> Link:
    """A Link fitted to the timings of one `op` (`collectives.timing.time_collective` rows), in
    relative error (`fit_alpha_beta_points`): t = latency_steps(op, N, algorithm) x alpha +
    (N-1)/N-of-the-message bytes x beta. The exchange's alpha is the price of its one round,
    which a ring's N-1 steps would divide among N-1 (at N = 2 the two agree)."""
    rows = [t for t in timings if t["op"] == op and t["world_size"] > 1]
    if len(rows) < 2:
        raise ValueError(f"need at least two timings of {op} on more than one rank; "
                         f"got {len(rows)}")
    fit = fit_alpha_beta_points([latency_steps(op, r["world_size"], algorithm) for r in rows],
                                [ring_bytes_sent(op, r["nbytes"], r["world_size"]) for r in rows],
                                [r["seconds"] for r in rows])
    per = "round" if algorithm == "exchange" else "ring step"
    source = (f"measured: alpha-beta fit of {op} ({algorithm}) on this machine "
              f"(alpha {fit.alpha * 1e6:.1f} us/{per}, {fit.beta / 1e9:.2f} GB/s)")
    return Link(name or f"fit:{op}", fit.alpha, 1.0 / fit.beta, source, domain, algorithm)


def fit_op_links(timings: Iterable[dict], name: str = "this machine") -> OpLinks:
    """This machine's OpLinks: every op swept (`workers/collective_sweep.py`) fitted alone
    (`fit_link`), by the transport that sent it: a row with "transport": "direct" is the
    direct exchange (one round), any other torch's collective (a ring). An op swept by both
    transports is refused: sweep the one the stages really send."""
    timings = list(timings)
    transports: dict[str, set] = {}
    for t in timings:
        transports.setdefault(t["op"], set()).add(t.get("transport", "torch"))
    both = [op for op, ts in transports.items() if len(ts) > 1]
    if both:
        raise ValueError(f"{', '.join(both)} timed by two transports: keep the one the stages "
                         f"send")
    links = {}
    for op, (transport,) in transports.items():
        algorithm = "exchange" if transport == "direct" else "ring"
        links[op] = fit_link(timings, op, algorithm, name=f"{name}: {op}")
    return OpLinks(name, links, "measured: one alpha-beta fit per op, by its transport")


def max_world_size(link: str | Link | Machine | OpLinks) -> int | None:
    """The most ranks `link` can join: a single-domain link's domain (the smallest of an
    OpLinks' domains), else None (any)."""
    lk = get_link(link)
    if isinstance(lk, OpLinks):
        domains = [x.domain for x in lk.links.values() if x.domain is not None]
        return min(domains) if domains else None
    return lk.domain if isinstance(lk, Link) else None


def _ring(op: str, nbytes: float, n: int, link: Link) -> tuple[float, float]:
    """(latency, bandwidth) seconds of one collective of n ranks on one link class: its
    algorithm's steps (a ring's, or the exchange's one round), the ring's bytes."""
    return (latency_steps(op, n, link.algorithm) * link.alpha,
            ring_bytes_sent(op, nbytes, n) * link.beta)


def collective_terms(op: str, nbytes: float, world_size: int,
                     link: str | Link | Machine | OpLinks) -> dict[str, float]:
    """One collective's {"latency_s", "bandwidth_s"}: steps x alpha and bytes sent x beta.

    On an OpLinks, `op`'s own Link. On a Link of algorithm "exchange", one round: 1 x alpha,
    and the ring's bytes. On a ring Link: ring_steps 2(N-1) for all-reduce, N-1 for the
    others; bytes sent
    2(N-1)/N x nbytes for all-reduce, (N-1)/N x nbytes for reduce-scatter and all-gather,
    nbytes for broadcast (`nbytes` is the full message, as in collectives/volume.py). A
    single-domain link refuses N above its domain. On a Machine with N <= node_size, the intra
    link's ring; above, N must be whole nodes (m = N / g). A reduce-scatter or all-gather is
    NCCL's flat ring of N: latency (N-m) intra steps + (m-1) network steps; bandwidth the
    intra-node share of nbytes on NVLink plus the network's share, nbytes/g per GPU through
    the node's NICs (the two added, not overlapped: an upper bound on a pipelined ring).
    All-reduce = hierarchical reduce-scatter + all-gather ((g-1) + (m-1) steps each);
    broadcast = network, then inside the node.
    """
    if op not in RING_OPS:
        raise ValueError(f"op must be one of {', '.join(RING_OPS)}; got {op!r}")
    checked_number("nbytes", nbytes)
    n = checked_integer("world_size", world_size)
    lk = get_link(link)
    if isinstance(lk, OpLinks):
        lk = lk.link(op)
    if isinstance(lk, Link):
        if lk.domain is not None and n > lk.domain:
            raise ValueError(f"{lk.name} joins at most {lk.domain} ranks (one node); got "
                             f"world_size {n}: across nodes use a Machine ({', '.join(MACHINES)})")
        latency, bandwidth = _ring(op, nbytes, n, lk)
        return {"latency_s": latency, "bandwidth_s": bandwidth}
    g = lk.node_size
    if n <= g:
        latency, bandwidth = _ring(op, nbytes, n, lk.intra)
        return {"latency_s": latency, "bandwidth_s": bandwidth}
    if n % g:
        raise ValueError(f"world_size {n} spans nodes of {g} on {lk.name}: use whole nodes "
                         f"(a multiple of {g})")
    m = n // g
    # the network carries what the node's g GPUs send, (m-1)/m x nbytes/g each, through its NICs
    net_beta = lk.inter.beta * g / lk.nics_per_node
    if op == "broadcast":
        inner = _ring(op, nbytes, g, lk.intra)
        outer = ((m - 1) * lk.inter.alpha, nbytes * lk.inter.beta)  # the root node sends it
        return {"latency_s": inner[0] + outer[0], "bandwidth_s": inner[1] + outer[1]}
    half = "reduce_scatter" if op in ("reduce_scatter", "all_reduce") else "all_gather"
    inner = _ring(half, nbytes, g, lk.intra)
    outer = (ring_steps(half, m) * lk.inter.alpha, ring_bytes_sent(half, nbytes / g, m) * net_beta)
    if op != "all_reduce":
        # NCCL runs AllGather and ReduceScatter as a flat ring over all N GPUs (the ring
        # algorithm; its tree is AllReduce-only, PAT one GPU per node), not as NVLink + network
        # rings: N-1 steps, m-1 of them across nodes. NVIDIA/nccl src/graph/tuning.cc prices a
        # ring (nsteps - nInterSteps) x intraLat + nInterSteps x interLat, nsteps = N-1 and
        # nInterSteps = nNodes-1 for these two: so do we, with the alphas above.
        steps = ring_steps(half, n)
        latency = (steps - (m - 1)) * lk.intra.alpha + (m - 1) * lk.inter.alpha
        return {"latency_s": latency, "bandwidth_s": inner[1] + outer[1]}
    times = 2
    return {"latency_s": times * (inner[0] + outer[0]),
            "bandwidth_s": times * (inner[1] + outer[1])}


def collective_time(op: str, nbytes: float, world_size: int,
                    link: str | Link | Machine | OpLinks) -> float:
    """Seconds one collective takes on `link`: latency + bandwidth (`collective_terms`).
    N = 1 costs 0."""
    terms = collective_terms(op, nbytes, world_size, link)
    return terms["latency_s"] + terms["bandwidth_s"]
