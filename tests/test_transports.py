"""The seam for a new collective (zero_lab/collectives/transports.py, issue 51): a Transport
registered under a name carries every all-gather and reduce-scatter of stages 1-3 once
`shard(..., transport=name)` names it, and changes nothing else (same weights as the direct
exchange it wraps). Cases: tests/workers/transport_cases.py, in the launch of world_cases.py
on 2 gloo ranks."""

from __future__ import annotations

import pytest
from common import case_reports


@pytest.fixture(scope="module")
def reports() -> tuple[dict, ...]:
    return case_reports("transports", 2)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_a_plugged_in_collective_carries_the_stage(reports, stage):
    for rank, rep in enumerate(reports):
        plugged, direct = rep[f"{stage} counted"], rep[f"{stage} direct"]
        assert plugged["calls"] == ["all_gather", "reduce_scatter"], (rank, plugged["calls"])
        assert direct["calls"] == [], (rank, direct["calls"])  # only when named
        assert plugged["weights"] == direct["weights"], rank
