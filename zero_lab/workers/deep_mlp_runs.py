"""The seed blog's deep MLP (scaled down), trained under each requested run on every rank.

Notebooks 03 and 04 launch it, each asking for the runs it teaches. `--runs` is JSON
{label: options}: options are keyword arguments of `zero_lab.stages.shard` ({"stage": 1},
{"stage": 1, "zero1_variant": "all_reduce"}, {"stage": 2, "bucket_mb": 4}), {"blog": 1} /
{"blog": 2}, the seed blog's own ZeRO-1 / ZeRO-2 (`zero_lab.course.seed_blog.BlogZero`), or
{"plain": 1, "beside": "stage 1"}: the plain stage (zero_lab/plain/stage1.py; "bucket_mb"
optional) beside an earlier run of the same launch.

Every rank first trains one plain model on the whole global batch: the reference. Each run
then starts from the same initialisation and trains the ordinary loop (forward, backward,
`opt.step()`, `opt.zero_grad()`) on this rank's share of each global batch; its last step is
measured. Per run it reports what this rank holds after backward, its peak during that step
(`zero_lab.measure.memory.PeakMemory`), every collective the step issued (`CommLedger`), the median
time of the other steps, and how far the trained weights end from the reference. A plain
run (no memory measured) also reports how far it ends from the run it is beside; both report
their last step's collectives as `CommLedger.signature()`.

With --time-collectives (notebook 03) it also reports what the backend's own profiler shows
for one `reduce_scatter_single`, and the best-of-9 times of three ways to reduce a gradient
buffer the size of the model: all-reduce, torch's reduce-scatter, zero_lab's direct exchange.

    deep_mlp_runs.py --width 512 --depth 6 --batch 16 --steps 6 \\
        --runs '{"stage 1": {"stage": 1}, "blog ZeRO-2": {"blog": 2}}' [--time-collectives]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from zero_lab.collectives import CommLedger, exchange
from zero_lab.course.seed_blog import BlogZero
from zero_lab.course.step_record import record
from zero_lab.course.workloads import deep_mlp, mlp_batch, mse_loss, rank_slice, train
from zero_lab.launch import init_worker, report
from zero_lab.plain import stage0, stage1, stage2, stage3
from zero_lab.stages import full_state_dict, shard

MiB = 2**20
PLAIN = {0: stage0, 1: stage1, 2: stage2, 3: stage3}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)  # the global batch, split over ranks
    parser.add_argument("--steps", type=int, default=6)  # training steps per run
    parser.add_argument("--runs", default='{"stage 0": {"stage": 0}, "stage 1": {"stage": 1}}',
                        help="JSON {label: shard() options, or {\"blog\": 1 or 2}}")
    parser.add_argument("--step-record", action="store_true",
                        help="also one step of DDP and stages 1-3 on 13 parameters, phase by "
                        "phase (zero_lab/course/step_record.py), for the step view")
    parser.add_argument("--time-collectives", action="store_true",
                        help="also profile one reduce-scatter and time three reductions")
    return parser.parse_args()


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def build(args, how: dict, device: torch.device):
    """A fresh model from seed 0 and its optimizer, as run `how` asks."""
    torch.manual_seed(0)
    model = deep_mlp(args.width, args.depth).to(device)
    if "blog" in how:
        return model, BlogZero(model, how["blog"])
    if "plain" in how:
        stage = PLAIN[how["plain"]]
        return stage.shard(model, adam, **({"bucket_mb": how["bucket_mb"]} if "bucket_mb" in how
                                           else {}))
    return shard(model, optimizer=adam, **how)


def reference_weights(args, device: torch.device) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, plain Adam: what every run must end at."""
    torch.manual_seed(0)
    reference = deep_mlp(args.width, args.depth).to(device)
    opt = adam(reference.parameters())
    for step in range(args.steps):
        mse_loss(reference, mlp_batch(step, args.batch, args.width, device=device)).backward()
        opt.step()
        opt.zero_grad()
    return reference.state_dict()


def weights_of(model, opt, how: dict) -> dict[str, torch.Tensor]:
    if how.get("plain") != 3:
        return full_state_dict(model)  # a plain stage 0-2's parameters are full after a step
    for unit in opt.units:  # plain stage 3: gather every unit, read, release
        unit.gather()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for unit in opt.units:
        unit.release()
    return weights


def run(args, how: dict, batches, ref_weights, device: torch.device) -> tuple[dict, dict]:
    """The run's report, and its trained weights."""
    model, opt = build(args, how, device)
    out = train(model, opt, batches, steps=args.steps - 1, measure_memory=False, device=device)
    # The last step, measured: memory and bytes. Its peak is counted storage by storage
    # (PeakMemory's CPU mode, which sees CUDA tensors too): what this run holds and allocates,
    # not the allocator's high-water mark, which would include the reference's weights.
    # A plain run's memory is not measured: the notebooks compare its weights and bytes.
    with CommLedger() as ledger:
        last = train(model, opt, lambda k: batches(args.steps - 1), steps=1,
                     measure_memory="plain" not in how, device=device)
    weights = weights_of(model, opt, how)
    memory = {k: last[k] for k in ("held_after_backward", "peak_bytes") if k in last}
    return {
        **memory,
        "signature": ledger.signature(),
        "comm": ledger.summary(),
        "volume": ledger.volume(),
        "sent_bytes": ledger.total_bytes(),
        "step_ms": 1e3 * sorted(out["step_times"])[len(out["step_times"]) // 2],
        "max_abs_diff": largest_difference(weights, ref_weights),
    }, weights


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def timed_ms(fn, repeats: int = 9) -> list[float]:
    """`repeats` calls of `fn`, each timed on the slowest rank (barriers around it), in ms,
    sorted: the first is the best, the middle the median."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)


def time_collectives(n_params: int, world_size: int, device: torch.device) -> dict:
    """What the backend runs for one reduce-scatter (its own profiler events), and one
    model-sized gradient buffer reduced three ways (every timing, for the spread)."""
    probe_out = torch.empty(1024, device=device)
    probe_in = torch.ones(1024 * world_size, device=device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.reduce_scatter_single(probe_out, probe_in)
    backend_ops = sorted({e.name for e in prof.events() if e.name.startswith(("gloo:", "nccl:"))})

    n_pad = -(-n_params // world_size)
    grads = torch.randn(n_pad * world_size, device=device)
    mine = torch.empty(n_pad, device=device)
    summed = grads.clone()  # the all-reduce works in place
    collective_ms = {
        "all_reduce": timed_ms(lambda: dist.all_reduce(summed)),
        "torch reduce_scatter_single": timed_ms(lambda: dist.reduce_scatter_single(mine, grads)),
        "zero_lab exchange.reduce_scatter": timed_ms(lambda: exchange.reduce_scatter(mine, grads)),
    }
    return {"reduce_scatter_runs": backend_ops, "collective_ms": collective_ms}


def main() -> None:
    args = parse_args()
    runs = json.loads(args.runs)
    info = init_worker()

    def batches(step):  # this rank's rows of global batch `step`
        full = mlp_batch(step, args.batch, args.width, device=info.device)
        return rank_slice(full, info.rank, info.world_size)

    ref_weights = reference_weights(args, info.device)
    results, kept = {}, {}  # kept: the weights of the runs a plain run is beside
    beside = {how["beside"] for how in runs.values() if "plain" in how}
    labels = list(runs)
    for i, (label, how) in enumerate(runs.items()):
        if "plain" in how and how.get("beside") not in labels[:i]:
            raise ValueError(f"{label!r}: 'beside' must name a run before it, "
                             f"got {how.get('beside')!r}")
    for label, how in runs.items():
        r, weights = run(args, how, batches, ref_weights, info.device)
        results[label] = r
        if label in beside:
            kept[label] = weights
        elif "plain" not in how:  # the signature only where a plain run is compared
            del r["signature"]
        if "plain" in how:
            r["vs_beside"] = largest_difference(weights, kept[how["beside"]])
        count = sum(op["count"] for op in r["comm"].values())
        peak = f"peak {r['peak_bytes'] / MiB:.1f} MiB, " if "peak_bytes" in r else ""
        print(f"{label}: {peak}{r['step_ms']:.1f} ms a step, "
              f"{count} collectives a step")  # under 110 characters for every label
    sizes = [t.numel() for t in ref_weights.values()]
    out = {"runs": results, "n_params": sum(sizes), "largest_param": max(sizes)}
    if args.time_collectives:
        out.update(time_collectives(sum(sizes), info.world_size, info.device))
    if args.step_record:
        out["step_record"] = record(info.rank, info.world_size)
    report(out)


if __name__ == "__main__":
    main()
