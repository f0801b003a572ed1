"""Collectives from first principles: ring algorithms, a byte ledger, their bytes and timing,
and the direct exchange the stages send on gloo.

Every ZeRO stage is a choice of *which collective moves which bytes when*. The modules,
in reading order:

    ring.py        reduce-scatter, all-gather and all-reduce on isend/irecv only (notebook 02)
    volume.py      the bytes a rank sends per collective (ring and ZeRO-paper counts)
    timing.py      timing sweeps, the alpha-beta fit, algbw / busbw
    torch_names.py torch's single-tensor all-gather and reduce-scatter under the course's names
    ledger.py      CommLedger: records every collective a block issues, with its bytes
    exchange.py    reduce-scatter and all-gather as one round of point-to-point messages:
                   what the stages send on gloo, whose own reduce-scatter is an all-reduce
    transports.py  where a stage's collectives are chosen: the seam a new one plugs into
    chain.py       collectives run one after another behind one handle (hybrid sharding's
                   reduce-scatter inside a group, then all-reduce across the groups)

The names below are re-exported, so `from zero_lab.collectives import CommLedger` works.
"""

from zero_lab.collectives.ledger import CommLedger, CommRecord, recorded_as
from zero_lab.collectives.ring import (
    all_gather_step,
    reduce_scatter_step,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_schedule,
)
from zero_lab.collectives.timing import (
    AlphaBeta,
    AlphaBetaModel,
    algbw,
    busbw,
    fit_alpha_beta,
    fit_alpha_beta_points,
    message_sizes,
    sweep,
    time_collective,
)
from zero_lab.collectives.volume import (
    RING_OPS,
    bus_factor,
    describe_bytes,
    ring_bytes_sent,
    ring_steps,
    zero_volume,
)

__all__ = [
    "RING_OPS", "AlphaBeta", "AlphaBetaModel", "CommLedger", "CommRecord", "algbw",
    "all_gather_step", "bus_factor", "busbw", "describe_bytes", "fit_alpha_beta",
    "fit_alpha_beta_points", "message_sizes", "recorded_as", "reduce_scatter_step",
    "ring_all_gather", "ring_all_reduce", "ring_bytes_sent", "ring_reduce_scatter",
    "ring_schedule", "ring_steps", "sweep", "time_collective", "zero_volume",
]
