"""Test worker for tests/test_collectives.py: ring ops vs torch, and what the ledger records.

Every rank runs all cases and returns one dict; the parent asserts. tests/workers/
world_cases.py runs `run` in the one launch per world size it shares with the other case
workers; `main` runs this worker alone (e.g. to debug it).
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from zero_lab.collectives import (
    CommLedger,
    exchange,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from zero_lab.launch import init_worker, report


def run(rank: int, n: int) -> dict:
    """Every case on this rank, in one order (the data differs from rank to rank)."""
    gen = torch.Generator().manual_seed(1234 + rank)

    def rand(shape, dtype):
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen, dtype=dtype)
        return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)

    return {**ring_ops_equal_torch(n, rand), **ring_bytes_sent(n, rand),
            **ledger_blocks(rank, n), **direct_exchange(rank, n, rand)}


def same(a, b):
    if a.dtype.is_floating_point:
        return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    return bool(torch.equal(a, b))


def ring_ops_equal_torch(n: int, rand) -> dict:
    mismatches = []
    checked = 0
    for dtype in (torch.float32, torch.float64, torch.int64):
        # all-reduce: any size, including sizes smaller than and not divisible by N
        for shape in [(1,), (2,), (3,), (5,), (7,), (13,), (1000,), (1001,), (6, 7), (0,)]:
            x = rand(shape, dtype)
            mine, ref = x.clone(), x.clone()
            ring_all_reduce(mine)
            dist.all_reduce(ref)
            checked += 1
            if not same(mine, ref):
                mismatches.append(f"all_reduce {shape} {dtype}")
        # reduce-scatter / all-gather: chunk sizes 1, 3, 7, 100 (not powers of two, not aligned)
        for k in (1, 3, 7, 100):
            x = rand((n * k,), dtype)
            mine, ref = torch.empty(k, dtype=dtype), torch.empty(k, dtype=dtype)
            before = x.clone()
            ring_reduce_scatter(mine, x)
            dist.reduce_scatter_single(ref, x)
            checked += 1
            if not same(mine, ref) or not torch.equal(x, before):
                mismatches.append(f"reduce_scatter k={k} {dtype}")
            part = rand((k,), dtype)
            mine, ref = torch.empty(n * k, dtype=dtype), torch.empty(n * k, dtype=dtype)
            ring_all_gather(mine, part)
            dist.all_gather_single(ref, part)
            checked += 1
            if not same(mine, ref):
                mismatches.append(f"all_gather k={k} {dtype}")
    # non-contiguous tensors and 2-D outputs
    x = rand((5, 4), torch.float64).t()
    mine, ref = x.clone(), x.clone()
    ring_all_reduce(mine)
    dist.all_reduce(ref)
    checked += 1
    if not same(mine, ref):
        mismatches.append("all_reduce non-contiguous")
    out_mine = torch.empty(4, n * 3, dtype=torch.float64).t()  # non-contiguous output
    out_ref = torch.empty(n * 3, 4, dtype=torch.float64)
    part = rand((3, 4), torch.float64)
    ring_all_gather(out_mine, part)
    dist.all_gather_single(out_ref, part)
    checked += 1
    if not same(out_mine, out_ref):
        mismatches.append("all_gather non-contiguous output")
    rs_out = torch.empty(2, 3, dtype=torch.float64)
    rs_ref = torch.empty(2, 3, dtype=torch.float64)
    x = rand((n * 2, 3), torch.float64)
    ring_reduce_scatter(rs_out, x)
    dist.reduce_scatter_single(rs_ref, x)
    checked += 1
    if not same(rs_out, rs_ref):
        mismatches.append("reduce_scatter 2-D")
    # the identity all-reduce = reduce-scatter + all-gather, on torch's own ops
    x = rand((n * 11,), torch.float64)
    ar = x.clone()
    dist.all_reduce(ar)
    piece = torch.empty(11, dtype=torch.float64)
    dist.reduce_scatter_single(piece, x)
    rs_ag = torch.empty(n * 11, dtype=torch.float64)
    dist.all_gather_single(rs_ag, piece)
    checked += 1
    if not same(rs_ag, ar):
        mismatches.append("identity")
    errors = {}
    try:
        ring_reduce_scatter(torch.empty(3), torch.empty(3 * n + 1))
    except ValueError as exc:
        errors["reduce_scatter_size"] = str(exc)
    try:
        ring_all_gather(torch.empty(3 * n + 1), torch.empty(3))
    except ValueError as exc:
        errors["all_gather_size"] = str(exc)
    return {"checked": checked, "mismatches": mismatches, "errors": errors}


def ring_bytes_sent(n: int, rand) -> dict:
    ring_sent = {}
    for numel in (n * 1000, 1001, 7):
        t = rand((numel,), torch.float32)
        with CommLedger() as ledger:
            ring_all_reduce(t)
        ring_sent[f"all_reduce_{numel}"] = {
            "sent": ledger.total_bytes("send"), "ops": sorted({r.op for r in ledger.records}),
            "sends": ledger.count("send"), "recvs": ledger.count("recv")}
        out = torch.empty(numel, dtype=torch.float32)
        with CommLedger() as ledger:
            ring_reduce_scatter(out, rand((n * numel,), torch.float32))
        ring_sent[f"reduce_scatter_{numel}"] = {"sent": ledger.total_bytes("send")}
        out = torch.empty(n * numel, dtype=torch.float32)
        with CommLedger() as ledger:
            ring_all_gather(out, rand((numel,), torch.float32))
        ring_sent[f"all_gather_{numel}"] = {"sent": ledger.total_bytes("send")}
    return {"ring_sent": ring_sent}


class AllReduceInBackward(torch.autograd.Function):
    """Identity forward; all-reduces the incoming gradient inside backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def ledger_blocks(rank: int, n: int) -> dict:
    """What the ledger records for every call style."""
    blocks = {}
    with CommLedger() as ledger:
        t = torch.ones(10)
        dist.all_reduce(t)
    blocks["all_reduce"] = ledger.as_dicts()
    with CommLedger() as ledger:
        f64 = torch.float64
        dist.all_gather_single(torch.empty(6 * n, dtype=f64), torch.ones(6, dtype=f64))
    blocks["all_gather_single"] = ledger.as_dicts()
    with CommLedger() as ledger:
        bf16 = torch.bfloat16
        dist.reduce_scatter_single(torch.empty(6, dtype=bf16), torch.ones(6 * n, dtype=bf16))
    blocks["reduce_scatter_single"] = ledger.as_dicts()
    with CommLedger() as ledger:
        dist.broadcast(torch.ones(9, dtype=torch.int32), src=0)
    blocks["broadcast"] = ledger.as_dicts()
    with CommLedger() as ledger:
        dist.all_reduce(torch.ones(8), async_op=True).wait()
    blocks["async"] = ledger.as_dicts()
    with CommLedger() as ledger:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        works = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(
                lambda p: works.append(dist.all_reduce(p.grad, async_op=True)))
        AllReduceInBackward.apply(model(torch.randn(5, 4))).sum().backward()
        for w in works:
            w.wait()
    blocks["backward"] = ledger.as_dicts()
    with CommLedger() as ledger:
        funcol.wait_tensor(funcol.all_reduce(torch.ones(12), "sum", dist.group.WORLD))
        funcol.wait_tensor(funcol.all_gather_tensor(torch.ones(5), 0, dist.group.WORLD))
        funcol.wait_tensor(
            funcol.reduce_scatter_tensor(torch.ones(5 * n), "sum", 0, dist.group.WORLD))
    blocks["functional"] = ledger.as_dicts()
    with CommLedger() as ledger:
        gathered = [torch.empty(4) for _ in range(n)]
        dist.all_gather(gathered, torch.ones(4))
        dist.reduce_scatter(torch.empty(4), [torch.ones(4) for _ in range(n)])
        dist.barrier()
    blocks["list_forms"] = ledger.as_dicts()
    with CommLedger() as ledger:
        ops = [dist.P2POp(dist.isend, torch.ones(3), (rank + 1) % n),
               dist.P2POp(dist.irecv, torch.empty(3), (rank - 1) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    blocks["batch_p2p"] = ledger.as_dicts()
    with CommLedger() as outer:
        dist.all_reduce(torch.ones(2))
        with CommLedger() as inner:
            dist.all_reduce(torch.ones(3))
    blocks["nested_outer"] = outer.as_dicts()
    blocks["nested_inner"] = inner.as_dicts()
    return {"blocks": blocks}


def direct_exchange(rank: int, n: int, rand) -> dict:
    """zero_lab.collectives.exchange equals torch's collectives."""

    direct_mismatches, direct_checked = [], 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        ops = [dist.ReduceOp.SUM] + ([dist.ReduceOp.AVG] if dtype.is_floating_point else [])
        for k in (1, 3, 7, 100):
            for op in ops:
                x = rand((n * k,), dtype)
                before = x.clone()
                mine, ref = torch.empty(k, dtype=dtype), torch.empty(k, dtype=dtype)
                exchange.reduce_scatter(mine, x, op=op)
                dist.reduce_scatter_single(ref, x, op=op)
                direct_checked += 1
                tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
                close = (torch.allclose(mine.double(), ref.double(), **tol) if tol
                         else same(mine, ref))
                if not close or not torch.equal(x, before):
                    direct_mismatches.append(f"reduce_scatter k={k} {dtype} {op}")
            part = rand((k,), dtype)
            mine, ref = torch.empty(n * k, dtype=dtype), torch.empty(n * k, dtype=dtype)
            exchange.all_gather(mine, part)
            dist.all_gather_single(ref, part)
            in_place = torch.empty(n * k, dtype=dtype)
            in_place[rank * k:(rank + 1) * k] = part
            exchange.all_gather(in_place, in_place[rank * k:(rank + 1) * k])  # input = own chunk
            direct_checked += 1
            if not (torch.equal(mine, ref) and torch.equal(in_place, ref)):
                direct_mismatches.append(f"all_gather k={k} {dtype}")
    # Several exchanges in flight at once (stage 2 keeps two), waited in order and out of order.
    xs = [rand((n * 50,), torch.float32) for _ in range(3)]
    outs = [torch.empty(50) for _ in xs]
    works = [exchange.reduce_scatter(o, x, async_op=True) for o, x in zip(outs, xs, strict=True)]
    gathered = torch.empty(n * 50)
    ag_work = exchange.all_gather(gathered, outs[0].new_full((50,), float(rank)), async_op=True)
    for w in (works[2], works[0], ag_work, works[1]):
        w.wait()
    for o, x in zip(outs, xs, strict=True):
        ref = torch.empty(50)
        dist.reduce_scatter_single(ref, x)
        direct_checked += 1
        if not same(o, ref):
            direct_mismatches.append("reduce_scatter in flight together")
    direct_checked += 1
    if not torch.equal(gathered, torch.arange(n).float().repeat_interleave(50)):
        direct_mismatches.append("all_gather in flight together")
    direct_errors = {}
    for key, call in {
        "op": lambda: exchange.reduce_scatter(torch.empty(2), torch.empty(2 * n),
                                              op=dist.ReduceOp.MAX),
        "size": lambda: exchange.reduce_scatter(torch.empty(3), torch.empty(3 * n + 1)),
        "dtype": lambda: exchange.all_gather(torch.empty(2 * n),
                                             torch.empty(2, dtype=torch.float64)),
        "strided": lambda: exchange.all_gather(torch.empty(2 * n, 2).t(), torch.empty(2, 2)),
    }.items():
        try:
            call()
        except ValueError as exc:
            direct_errors[key] = str(exc)
    # What a ledger sees: one record per exchange, as the collective it implements.
    model = torch.nn.Linear(3, n * 2, bias=False)
    with CommLedger() as ledger:
        exchange.reduce_scatter(torch.empty(4), torch.ones(4 * n))
        exchange.all_gather(torch.empty(5 * n, dtype=torch.float64),
                            torch.ones(5, dtype=torch.float64), async_op=True).wait()
        model.weight.register_post_accumulate_grad_hook(
            lambda p: exchange.reduce_scatter(torch.empty(6), p.grad.view(-1)))
        model(torch.ones(1, 3)).sum().backward()
        dist.all_reduce(torch.ones(2))  # the ledger records again after an exchange
    return {"direct": {"checked": direct_checked, "mismatches": direct_mismatches,
                       "errors": direct_errors, "records": ledger.as_dicts()}}


def main() -> None:
    info = init_worker()
    report(run(info.rank, info.world_size))


if __name__ == "__main__":
    main()
