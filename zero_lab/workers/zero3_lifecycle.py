"""Stage 3's gather -> compute -> release lifecycle, measured on every rank.

Notebook 05 runs it. The measuring itself is `zero_lab.measure.memory_timeline`.

    torchrun --nproc-per-node 2 -m zero_lab.workers.zero3_lifecycle --width 256 --depth 6

On the seed blog's model shape (`depth` x Linear(d, d) + ReLU, scaled down) it measures one
training step of stage 3 with prefetch off and on, of stage 2 and of stage 0, each after a
warm-up step (Adam creates its states; stage 3 records the unit order). Reports per rank,
under "stage3_prefetch_off", "stage3_prefetch_on", "stage2", "stage0":

  samples     bytes alive after every op of the step (CPU: live storages, counted once each
              at their current size; CUDA: the allocator); `marks` labels samples, for
              stage 3 where a unit is gathered, released, or its gradient reduce-scattered
  ledger      the step's collectives: count, bytes and ZeRO-paper volume per op
  held        model-state bytes after backward (`zero_lab.measure.memory.held_bytes`)
  units       (stage 3) name, elements, padded, slice of every unit
  leftover    (stage 3, prefetch on) bytes alive after the step beyond the model states: 0
              when no full parameter, gradient or activation outlived the step
and once: `activations`, the activation (and transient gradient) bytes of the same step in
one process without sharding, `psi`, the number of parameters, and under "plain": the plain
stage 3 (zero_lab/plain/stage3.py) beside `shard(model, 3)`, each trained the same steps from
the same weights: the largest weight difference, each one's step collectives (`ledger`,
`signature`) and bytes.
"""

from __future__ import annotations

import argparse

import torch

from zero_lab.collectives import CommLedger
from zero_lab.course import workloads as W
from zero_lab.measure.memory_timeline import activation_bytes, measure_step
from zero_lab.plain import stage3
from zero_lab.stages import full_state_dict, shard


def plain_beside_real(mlp, batches: list, device: torch.device) -> dict:
    """The plain stage 3 and shard(model, 3), the same steps from seed 0: each one's last
    step's collectives, and how far apart their weights end."""
    out, weights = {}, {}
    for key in ("plain", "shard"):
        torch.manual_seed(0)
        model = mlp().to(device)
        model, opt = stage3.shard(model, adam) if key == "plain" else shard(model, 3, adam)
        for x, y in batches:
            ledger = CommLedger()
            with ledger:  # each step records anew: the last step's is reported
                W.mse_loss(model, (x, y)).backward()
                opt.step()
                opt.zero_grad()
        out[key] = {"ledger": ledger.summary(), "signature": ledger.signature(),
                    "sent_bytes": ledger.total_bytes()}
        weights[key] = opt.full_weights(model) if key == "plain" else full_state_dict(model)
    out["max_abs_diff"] = max(float((weights["plain"][k] - weights["shard"][k]).abs().max())
                              for k in weights["shard"])
    return out


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def main() -> None:
    from zero_lab.launch import init_worker, report

    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256, help="d of Linear(d, d)")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="rows per rank")
    parser.add_argument("--step-record", action="store_true",
                        help="also one step of DDP and stages 1-3 on 13 parameters, phase by "
                        "phase (zero_lab/course/step_record.py), for the step view")
    args = parser.parse_args()
    info = init_worker()
    rank, n, device = info.rank, info.world_size, info.device

    def batches():
        return [tuple(t.to(device) for t in W.rank_slice(
            W.mlp_batch(s, args.batch * n, args.width), rank, n)) for s in range(2)]

    def mlp():
        return W.deep_mlp(args.width, args.depth)

    out = {"psi": W.count_parameters(mlp()), "world_size": n}
    for key, stage, prefetch in (("stage3_prefetch_off", 3, False),
                                 ("stage3_prefetch_on", 3, True),
                                 ("stage2", 2, True), ("stage0", 0, True)):
        torch.manual_seed(0)
        out[key] = measure_step(mlp, batches(), device, stage, prefetch,
                                walk_live_tensors=key == "stage3_prefetch_on")
    torch.manual_seed(0)
    out["activations"] = activation_bytes(mlp(), *batches()[-1], device)
    out["plain"] = plain_beside_real(mlp, batches(), device)
    if args.step_record:
        from zero_lab.course.step_record import record

        out["step_record"] = record(rank, n)
    report(out)


if __name__ == "__main__":
    main()
