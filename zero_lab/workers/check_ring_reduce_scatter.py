"""Runs a learner's ring reduce-scatter on every rank and compares it with torch's.

Started by `zero_lab.grading.check_ring_reduce_scatter` (3 ranks, gloo):

    check_ring_reduce_scatter.py SOURCE_FILE FUNCTION_NAME

SOURCE_FILE holds the learner's function; it runs with torch, dist, nn and math imported.
Each rank reports, per case: whether its output matched `dist.reduce_scatter_single`, the
first values expected and received, the collectives the function issued (it must use only
isend/irecv) and the bytes it sent. An exception is reported with its case, then re-raised
so that torchrun stops every rank at once instead of leaving the others waiting.
"""

import math
import sys
import traceback

import torch
import torch.distributed as dist

from zero_lab.collectives import CommLedger
from zero_lab.launch import init_worker, report

source_file, function_name = sys.argv[1], sys.argv[2]
namespace = {"torch": torch, "dist": dist, "nn": torch.nn, "math": math, "__name__": "learner"}
with open(source_file, encoding="utf-8") as f:
    exec(compile(f.read(), "<your function>", "exec"), namespace)
fn = namespace[function_name]

info = init_worker()
rank, n = info.rank, info.world_size
gen = torch.Generator().manual_seed(100 + rank)

# (output shape, dtype): chunk sizes that are odd, prime, 1, and a 2-D output
CASES = [((1,), torch.int64), ((5,), torch.int64), ((7,), torch.float64),
         ((1001,), torch.float32), ((4, 3), torch.float64)]

results = []
for i, (shape, dtype) in enumerate(CASES):
    numel = 1
    for d in shape:
        numel *= d
    in_shape = (n * shape[0], *shape[1:])
    if dtype.is_floating_point:
        data = torch.randn(in_shape, generator=gen, dtype=dtype)
    else:
        data = torch.randint(-50, 50, in_shape, generator=gen, dtype=dtype)
    keep = data.clone()
    expected = torch.empty(shape, dtype=dtype)
    dist.reduce_scatter_single(expected, data)
    got = torch.full(shape, -7, dtype=dtype)
    label = f"output {tuple(shape)} {str(dtype).removeprefix('torch.')}, input {tuple(in_shape)}"
    try:
        with CommLedger() as ledger:
            fn(got, data)
    except BaseException as exc:
        results.append({"case": i + 1, "label": label, "error": {
            "type": type(exc).__name__, "message": str(exc),
            "traceback": traceback.format_exc()}})
        report({"results": results})
        raise
    tol = 1e-5 if dtype == torch.float32 else 1e-9
    ok = bool(torch.allclose(got.double(), expected.double(), rtol=tol, atol=tol))
    results.append({
        "case": i + 1, "label": label, "ok": ok,
        "expected": expected.flatten()[:6].tolist(), "got": got.flatten()[:6].tolist(),
        "own_chunk": data.reshape(n, -1)[rank][:6].tolist(),
        "input_modified": not torch.equal(data, keep),
        "collectives": sorted({r.op for r in ledger.records} - {"send", "recv"}),
        "sent_bytes": ledger.total_bytes("send"),
        "expected_sent_bytes": (n - 1) * numel * data.element_size(),
    })
report({"results": results})
