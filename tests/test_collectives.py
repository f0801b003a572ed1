"""zero_lab.collectives: ring ops equal torch's, the ledger's byte counts, the alpha-beta fit.

Multi-rank checks come from tests/workers/collectives_cases.py, run in the one launch per world
size it shares with the other case workers (tests/common.py); everything else is pure and runs
in-process.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from common import case_reports

from zero_lab import grading
from zero_lab.collectives import (
    AlphaBeta,
    CommLedger,
    algbw,
    bus_factor,
    busbw,
    fit_alpha_beta,
    fit_alpha_beta_points,
    message_sizes,
    ring_bytes_sent,
    ring_schedule,
    ring_steps,
    zero_volume,
)
from zero_lab.collectives.ledger import _record


# N = 2 and 3: an even and an odd ring, both wrapping around. N = 4 cost 33 s of CI (4 ranks on
# 2 cores) for no path the other two miss.
@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N={n}")
def ranks(request):
    """(N, per-rank reports) of the case worker, from the launch on N ranks it shares with the
    other case workers (tests/common.py)."""
    n = request.param
    return n, case_reports("collectives", n)


# ------------------------------------------------------------------ ring ops vs torch


def test_ring_ops_equal_torch_on_random_tensors(ranks):
    n, reports = ranks
    for rep in reports:
        assert rep["checked"] == 58  # the worker really ran every case ...
        assert rep["mismatches"] == []  # ... and each equalled torch's collective


def test_ring_ops_reject_mismatched_sizes(ranks):
    n, reports = ranks
    errors = reports[0]["errors"]
    assert errors["reduce_scatter_size"] == (
        f"input must have world_size x output.numel() = {n} x 3 elements, got {3 * n + 1}")
    assert errors["all_gather_size"] == (
        f"output must have world_size x input.numel() = {n} x 3 elements, got {3 * n + 1}")


def _chunk_sizes(numel: int, n: int) -> list[int]:
    return [len(c) for c in torch.arange(numel).tensor_split(n)]


def test_rings_send_exactly_what_the_formula_says(ranks):
    n, reports = ranks
    for rank, rep in enumerate(reports):
        sent = rep["ring_sent"]
        for numel in (n * 1000, 1001, 7):
            nbytes = numel * 4
            # reduce-scatter / all-gather: N equal chunks of `numel`: (N-1)/N of N*numel.
            assert sent[f"reduce_scatter_{numel}"]["sent"] == ring_bytes_sent(
                "reduce_scatter", n * nbytes, n) == (n - 1) * nbytes
            assert sent[f"all_gather_{numel}"]["sent"] == (n - 1) * nbytes
            # all-reduce: every chunk but my own in reduce-scatter, all but my right
            # neighbour's in all-gather (chunk sizes differ by one when N does not divide).
            chunks = _chunk_sizes(numel, n)
            exact = 4 * (2 * numel - chunks[rank] - chunks[(rank + 1) % n])
            ar = sent[f"all_reduce_{numel}"]
            assert ar["sent"] == exact
            assert ar["ops"] == ["recv", "send"]  # point-to-point only
            assert ar["sends"] == ar["recvs"] == 2 * (n - 1)  # one message per step
            if numel % n == 0:
                assert exact == ring_bytes_sent("all_reduce", nbytes, n)


# ------------------------------------------------------------------ the ledger, on gloo


def _check(record, op, numel, dtype, elem, n, async_op=False, in_backward=False):
    nbytes = numel * elem
    assert record["op"] == op
    assert record["numel"] == numel and record["dtype"] == dtype
    assert record["nbytes"] == nbytes and record["world_size"] == n
    assert record["sent_bytes"] == ring_bytes_sent(op, nbytes, n)
    assert record["volume"] == zero_volume(op, nbytes)
    assert record["async_op"] is async_op and record["in_backward"] is in_backward


def test_ledger_records_plain_calls_with_ring_bytes(ranks):
    n, reports = ranks
    blocks = reports[-1]["blocks"]
    (ar,) = blocks["all_reduce"]
    _check(ar, "all_reduce", 10, "float32", 4, n)
    assert ar["sent_bytes"] == pytest.approx(2 * (n - 1) * 40 / n)
    (ag,) = blocks["all_gather_single"]  # the full (gathered) output is the message
    _check(ag, "all_gather", 6 * n, "float64", 8, n)
    assert ag["sent_bytes"] == (n - 1) * 6 * 8  # = (N-1)/N x output
    (rs,) = blocks["reduce_scatter_single"]  # the full input is the message
    _check(rs, "reduce_scatter", 6 * n, "bfloat16", 2, n)
    assert rs["sent_bytes"] == (n - 1) * 6 * 2
    (bc,) = blocks["broadcast"]
    _check(bc, "broadcast", 9, "int32", 4, n)
    assert bc["sent_bytes"] == 36


def test_ledger_sees_async_hooks_and_backward(ranks):
    n, reports = ranks
    blocks = reports[0]["blocks"]
    (asy,) = blocks["async"]
    _check(asy, "all_reduce", 8, "float32", 4, n, async_op=True)
    back = blocks["backward"]
    # 1 all-reduce inside Function.backward (sync) + 4 from post-accumulate-grad hooks
    # (Linear(4,3) and Linear(3,2): weights 12 and 6, biases 3 and 2), all during backward.
    assert [r["op"] for r in back] == ["all_reduce"] * 5
    assert all(r["in_backward"] for r in back)
    assert back[0]["numel"] == 10 and back[0]["async_op"] is False
    assert sorted(r["numel"] for r in back[1:]) == [2, 3, 6, 12]
    assert all(r["async_op"] for r in back[1:])


def test_ledger_sees_functional_list_form_p2p_and_nesting(ranks):
    n, reports = ranks
    blocks = reports[0]["blocks"]
    ar, ag, rs = blocks["functional"]
    _check(ar, "all_reduce", 12, "float32", 4, n, async_op=True)
    _check(ag, "all_gather", 5 * n, "float32", 4, n, async_op=True)
    _check(rs, "reduce_scatter", 5 * n, "float32", 4, n, async_op=True)
    ag, rs, barrier = blocks["list_forms"]
    _check(ag, "all_gather", 4 * n, "float32", 4, n)
    _check(rs, "reduce_scatter", 4 * n, "float32", 4, n)
    assert barrier["op"] == "barrier" and barrier["sent_bytes"] == 0
    send, recv = blocks["batch_p2p"]
    assert (send["op"], send["sent_bytes"], recv["op"], recv["sent_bytes"]) == (
        "send", 12, "recv", 0)
    # nested ledgers: the inner one sees its block, the outer one sees both
    assert [r["numel"] for r in blocks["nested_outer"]] == [2, 3]
    assert [r["numel"] for r in blocks["nested_inner"]] == [3]


def test_ledger_queries_sum_by_op():
    ledger = CommLedger()  # queries need no process group: fill records by hand
    n, psi = 4, 1000 * 4
    ledger.records += [
        _record("reduce_scatter", [torch.empty(1000)], n, False, True, "x"),
        _record("all_gather", [torch.empty(1000)], n, False, False, "x"),
        _record("all_reduce", [torch.empty(1000)], n, True, True, "x"),
        _record("send", [torch.empty(10, dtype=torch.float64)], n, True, False, "x"),
        _record("recv", [torch.empty(10, dtype=torch.float64)], n, True, False, "x"),
    ]
    assert ledger.count() == 5 and ledger.count("all_reduce") == 1 and ledger.count("x") == 0
    assert ledger.total_bytes("reduce_scatter") == 3000
    assert ledger.total_bytes("all_reduce") == 6000
    assert ledger.total_bytes() == 3000 + 3000 + 6000 + 80
    assert ledger.volume("all_reduce") == 2 * psi
    assert ledger.volume() == 4 * psi + 80  # RS + AG + AR(2x) + the send; recv counts 0
    assert ledger.payload_bytes() == 3 * psi + 160
    summary = ledger.summary()
    assert list(summary) == ["reduce_scatter", "all_gather", "all_reduce", "send", "recv"]
    assert summary["all_reduce"] == {"count": 1, "nbytes": psi, "sent_bytes": 6000.0,
                                     "volume": 2 * psi}
    table = ledger.table().splitlines()
    assert table[0].split()[:4] == ["op", "numel", "dtype", "nbytes"]
    assert table[2].split() == ["reduce_scatter", "1,000", "float32", "4,000", "3,000",
                                "backward"]
    assert table[-1].split() == ["total", "12,160", "12,080"]
    ledger.clear()
    assert ledger.count() == 0 and ledger.total_bytes() == 0


# ------------------------------------------------------------------ cost formulas


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 64])
def test_bus_factors_are_nccl_tests(n):
    assert bus_factor("all_reduce", n) == (2 * (n - 1) / n)
    assert bus_factor("reduce_scatter", n) == bus_factor("all_gather", n) == (n - 1) / n
    assert bus_factor("broadcast", n) == (1.0 if n > 1 else 0.0)
    assert ring_steps("all_reduce", n) == 2 * (n - 1)
    assert ring_steps("reduce_scatter", n) == ring_steps("all_gather", n) == n - 1


def test_ring_bytes_are_exact_for_padded_buffers():
    psi_bytes = 4 * 1_000_000  # a flat fp32 buffer of 1M elements (a multiple of 8)
    assert ring_bytes_sent("all_reduce", psi_bytes, 8) == 7_000_000
    assert ring_bytes_sent("reduce_scatter", psi_bytes, 8) == 3_500_000
    assert ring_bytes_sent("all_gather", psi_bytes, 1) == 0
    # all-reduce = reduce-scatter + all-gather, byte for byte
    for n in (2, 3, 5):
        assert ring_bytes_sent("all_reduce", 60, n) == (
            ring_bytes_sent("reduce_scatter", 60, n) + ring_bytes_sent("all_gather", 60, n))
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        bus_factor("allreduce", 2)


def test_algbw_and_busbw_follow_nccl_tests():
    # nccl-tests' PERFORMANCE.md: all-reduce busbw = algbw x 2(n-1)/n
    assert algbw(1e9, 0.01) == pytest.approx(100e9)
    assert busbw("all_reduce", 1e9, 0.01, 8) == pytest.approx(175e9)
    assert busbw("all_gather", 1e9, 0.01, 4) == pytest.approx(75e9)
    assert busbw("broadcast", 1e9, 0.01, 4) == pytest.approx(100e9)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_schedule_reduces_then_gathers_everything(n):
    steps = ring_schedule("all_reduce", n)
    assert len(steps) == 2 * (n - 1)
    have = [[{r} for _ in range(n)] for r in range(n)]  # whose data each (rank, chunk) holds
    for i, step in enumerate(steps):
        assert sorted(src for src, _, _ in step) == list(range(n))  # everyone sends once
        assert all(dst == (src + 1) % n for src, dst, _ in step)  # to the right neighbour
        new = [[set(c) for c in row] for row in have]
        for src, dst, chunk in step:
            if i < n - 1:
                assert not (have[src][chunk] & have[dst][chunk])  # nothing counted twice
                new[dst][chunk] |= have[src][chunk]
            else:
                new[dst][chunk] = set(have[src][chunk])
        have = new
        if i == n - 2:  # end of reduce-scatter: rank r holds the full sum of chunk r
            assert all(have[r][r] == set(range(n)) for r in range(n))
    assert all(cell == set(range(n)) for row in have for cell in row)
    assert ring_schedule("reduce_scatter", n) + ring_schedule("all_gather", n) == steps
    with pytest.raises(ValueError, match="op must be one of"):
        ring_schedule("broadcast", n)


def test_message_sizes_span_1k_to_64m():
    assert message_sizes() == [1024 * 4**k for k in range(9)]
    assert message_sizes(1000, 8000, 2) == [1000, 2000, 4000, 8000]
    with pytest.raises(ValueError):
        message_sizes(10, 5)


# ------------------------------------------------------------------ the alpha-beta fit


def _synthetic(alpha, beta, ops, ns, noise=0.0, seed=0):
    rng = random.Random(seed)
    rows = []
    for op in ops:
        for n in ns:
            for nbytes in message_sizes(1 << 10, 64 << 20, 2):
                t = AlphaBeta(alpha, beta).time(op, nbytes, n)
                rows.append({"op": op, "nbytes": nbytes, "world_size": n,
                             "seconds": t * (1 + rng.uniform(-noise, noise))})
    return rows


def test_fit_recovers_known_alpha_beta_exactly():
    alpha, beta = 35e-6, 2.5e9
    model = fit_alpha_beta(_synthetic(alpha, beta, ["all_reduce", "all_gather"], [2, 4, 8]))
    for fitted in (*model.per_op.values(), model.pooled):
        assert fitted.alpha == pytest.approx(alpha, rel=1e-9)
        assert fitted.beta == pytest.approx(beta, rel=1e-9)
    assert list(model.per_op) == ["all_reduce", "all_gather"]
    # predict: the op's own fit; an unmeasured op falls back to the pooled one
    assert model.predict("all_reduce", 4e9, 8) == pytest.approx(14 * alpha + 7e9 / beta)
    assert model.predict("broadcast", 1e6, 4) == pytest.approx(3 * alpha + 1e6 / beta)


def test_fit_with_noise_and_per_op_differences():
    rows = (_synthetic(50e-6, 1e9, ["all_reduce"], [2], noise=0.05, seed=1)
            + _synthetic(200e-6, 0.25e9, ["reduce_scatter"], [2], noise=0.05, seed=2))
    model = fit_alpha_beta(rows)
    assert model.per_op["all_reduce"].alpha == pytest.approx(50e-6, rel=0.15)
    assert model.per_op["all_reduce"].beta == pytest.approx(1e9, rel=0.1)
    assert model.per_op["reduce_scatter"].alpha == pytest.approx(200e-6, rel=0.15)
    assert model.per_op["reduce_scatter"].beta == pytest.approx(0.25e9, rel=0.1)


def test_fit_weighs_small_messages_too():
    # Plain least squares would ignore the microsecond points next to 64 MB ones; the
    # relative weighting must still get alpha from them.
    rows = _synthetic(1e-6, 10e9, ["all_reduce"], [2])
    assert fit_alpha_beta(rows).per_op["all_reduce"].alpha == pytest.approx(1e-6, rel=1e-6)


def test_fit_clips_negative_latency_and_rejects_flat_timings():
    pure_bandwidth = fit_alpha_beta_points([1, 1, 1], [1e3, 1e6, 1e9], [0.9e-6, 1e-3, 1.0])
    assert pure_bandwidth.alpha == 0.0
    assert pure_bandwidth.beta == pytest.approx(1e9, rel=0.1)
    with pytest.raises(ValueError, match="do not grow with message size"):
        fit_alpha_beta_points([1, 1, 1], [1e3, 1e6, 1e9], [3.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="world_size > 1"):
        fit_alpha_beta([{"op": "all_reduce", "nbytes": 8, "world_size": 1, "seconds": 1.0}])


def test_alpha_beta_time_is_zero_on_one_rank():
    assert AlphaBeta(1e-5, 1e9).time("all_reduce", 1e9, 1) == 0.0
    assert math.isclose(AlphaBeta(1e-5, 1e9).time("all_gather", 2e9, 2), 1e-5 + 1.0)


# ------------------------------------------------------------------ notebook 02's exercises
# The ring reduce-scatter's check is tested in tests/test_grading_ring.py.


def test_check_ring_bytes_sent_accepts_reference_rejects_mistakes(capsys):
    grading.check_ring_bytes_sent(ring_bytes_sent)
    assert "8/8 hidden cases pass" in capsys.readouterr().out

    def stub(op, nbytes, world_size):
        raise NotImplementedError

    def paper_volume(op, nbytes, world_size):
        return 2 * nbytes if op == "all_reduce" else nbytes

    def one_phase(op, nbytes, world_size):
        return (world_size - 1) / world_size * nbytes

    for fn, expected in [(stub, "not implemented yet"),
                         (paper_volume, "the ZeRO paper's rounded volume"),
                         (one_phase, "all-reduce has two phases")]:
        with pytest.raises(grading.ExerciseFailed, match=expected):
            grading.check_ring_bytes_sent(fn)


# ------------------------------------------------------------------ the direct exchange


def test_direct_exchange_equals_torch_collectives(ranks):
    """zero_lab.collectives.exchange (what the stages use on gloo) gives what torch's
    reduce_scatter_single and all_gather_single give: every dtype, SUM and AVG, in place,
    several in flight."""
    n, reports = ranks
    for rep in reports:
        direct = rep["direct"]
        assert direct["mismatches"] == []
        # every case ran: reduce-scatter (3 float dtypes x 4 sizes x SUM/AVG, int64 x 4 sizes
        # x SUM), all-gather (4 dtypes x 4 sizes), 3 reduce-scatters + 1 all-gather in flight
        assert direct["checked"] == 3 * 4 * 2 + 4 + 4 * 4 + 3 + 1


def test_direct_exchange_rejects_what_it_cannot_do(ranks):
    n, reports = ranks
    errors = reports[0]["direct"]["errors"]
    assert errors == {
        "op": "the direct reduce-scatter supports SUM and AVG, got RedOpType.MAX",
        "size": f"input must have world_size x 3 = {3 * n} elements, got {3 * n + 1}",
        "dtype": "dtypes differ: torch.float32 and torch.float64",
        "strided": "the direct exchange needs contiguous tensors",
    }


def test_ledger_records_a_direct_exchange_as_the_collective_it_implements(ranks):
    """Not as its 2(N-1) sends and receives: same bytes sent per rank as the ring."""
    n, reports = ranks
    rs, ag, rs_backward, ar = reports[0]["direct"]["records"]
    _check(rs, "reduce_scatter", 4 * n, "float32", 4, n)
    _check(ag, "all_gather", 5 * n, "float64", 8, n, async_op=True)
    _check(rs_backward, "reduce_scatter", 2 * n * 3, "float32", 4, n, in_backward=True)
    _check(ar, "all_reduce", 2, "float32", 4, n)
    assert rs["sent_bytes"] == (n - 1) * 4 * 4
    assert rs["torch_op"] == ag["torch_op"] == "zero_lab.collectives.exchange"


def test_the_twins_all_gather_writes_real_values_into_every_chunk(monkeypatch):
    """transport="none" (notebook 06's A/B, notebook 07's compute): a stage-3 unit's full
    buffer is fresh memory at every gather. If the twin wrote only its own chunk, the unit
    computed with whatever that memory held (NaN, denormals), and such numbers are slow: the
    stage-3 twin's Adam took 19.4 ms a step instead of 11.4 (aten::sqrt 2.0 ms a call instead
    of 0.72), so its 'compute' overstated the real stage's. Every chunk gets this rank's
    values, the bytes a real receive writes."""
    from zero_lab.collectives import exchange

    monkeypatch.setattr(exchange.dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(exchange.dist, "get_rank", lambda group=None: 1)
    freed = torch.full((6,), float("nan"))  # what a freed-and-regrown storage may hold
    exchange.all_gather_skipped(freed, torch.tensor([1.0, 2.0]))
    assert freed.tolist() == [1.0, 2.0] * 3
    in_place = torch.full((6,), float("nan"))
    in_place[2:4] = torch.tensor([5.0, 6.0])
    exchange.all_gather_skipped(in_place, in_place[2:4])  # own chunk given in place
    assert in_place.tolist() == [5.0, 6.0] * 3
