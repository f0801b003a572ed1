"""`reshard_after_forward=d` at stage 3 (FSDP2's int form; issue 35, finding 2): after forward
each unit keeps 1/d of its gathered buffer, so backward's all-gather runs inside a group of d
consecutive ranks instead of all N; measured on 4 gloo ranks with d = 2 against d = N
(reshard_after_forward=True), in the world_cases launch at N = 4
(tests/workers/reshard_int_cases.py):
- the weights equal one process's on the global batch (fp32 tolerance);
- between forward and backward a rank holds sum over units of (P_u + F_u) / d elements
  (P_u, F_u: a unit's padded trainable and frozen buffers), 4 bytes each, and nothing after;
- forward's all-gathers run over N ranks, backward's over d, each sending (d - 1)/d of its
  message under the ring algorithm instead of (N - 1)/N; the reduce-scatters are unchanged.
"""

from __future__ import annotations

import pytest
from common import case_reports

N, D = 4, 2


@pytest.fixture(scope="module")
def reports() -> tuple[dict, ...]:
    return case_reports("reshard_int", N)


def test_training_equals_one_process(reports):
    for rep in reports:
        for key in ("2", "True"):
            assert rep[key]["max_diff"] < 1e-5, (key, rep[key]["max_diff"])


def test_memory_between_forward_and_backward_is_the_formula(reports):
    for rep in reports:
        r = rep["2"]
        buffers = [p + f for p, f in r["units"]]
        assert r["between"] == sum(b // D * 4 for b in buffers)  # fp32, 1/d of each unit
        assert r["after"] == 0 and rep["True"]["between"] == 0


def test_backward_gathers_inside_groups_of_d(reports):
    for rep in reports:
        for key, d in (("2", D), ("True", N)):
            r = rep[key]
            buffers = sorted(b * 4 for p, f in r["units"] for b in (p, f) if b)
            forward = [g for g in r["gathers"] if not g[0]]
            backward = [g for g in r["gathers"] if g[0]]
            assert sorted(g[3] for g in forward) == sorted(g[3] for g in backward) == buffers
            assert all(g[1] == N and g[4] == g[3] * (N - 1) / N for g in forward), forward
            assert all(g[1] == d and g[4] == g[3] * (d - 1) / d for g in backward), backward
            assert all(g[2] == "post_forward" for g in backward) == (d < N)
            assert [s[0] for s in r["scatters"]] == [N] * len(r["units"])
            assert r["ops"] == ["all_gather", "reduce_scatter"]
