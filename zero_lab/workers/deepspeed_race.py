"""DeepSpeed's ZeRO stages, run from the course's configs, against one process (rank side).

    deepspeed_race.py CONFIG.json [CONFIG.json ...] [--steps 3]

For each config (zero_lab/practice/deepspeed/zeroK.json), twice: as written (bf16) and with
bf16 turned off (fp32, where one process must agree to rounding), this rank:
- builds the same small MLP from one seed and `deepspeed.initialize`s it with a torch Adam;
- trains `--steps` optimizer steps of the config's `gradient_accumulation_steps` micro-batches,
  its slice of each global micro-batch, every collective recorded by the course's CommLedger;
- gathers the fp32 master weights (`safe_get_full_fp32_param`, a collective at stage 3) and
  reports their largest distance from one process trained on the global batch.
It reports the ledger's records of the last step and each parameter's size, so the parent can
price the step with `collectives/volume.py` and `predict/knobs.py`. Run by
tests/test_deepspeed_configs.py through `zero_lab.launch.torchrun` (file-store rendezvous,
gloo on loopback, nothing listens).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from pathlib import Path

import torch
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.launch import init_worker, report

LR = 1e-2
IN, HIDDEN, OUT = 32, 128, 8


def mlp() -> nn.Module:
    """The same weights on every rank and in the reference: one seed."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batches(steps: int, k: int, world: int, micro: int) -> list[tuple[torch.Tensor, ...]]:
    """Each step's global batch, shaped (k, world, micro, features): the same on every rank."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(k, world, micro, IN, generator=g),
             torch.randn(k, world, micro, OUT, generator=g)) for _ in range(steps)]


def one_process(data, clip: float) -> list[torch.Tensor]:
    """fp32 training on the whole global batch: the weights every run must reach. Clipped as
    DeepSpeed clips (it clips to 1.0 even when a config says nothing; the configs say it)."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in data:
        nn.functional.mse_loss(model(x.flatten(0, 2)), y.flatten(0, 2)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def relative_update_error(weights, reference, start) -> float:
    """|w - reference| / |reference - start| over all parameters: how wrong the training was,
    as a fraction of what training changed (bf16's rounding is judged on this scale)."""
    num = sum(((w - r) ** 2).sum() for w, r in zip(weights, reference, strict=True))
    den = sum(((r - s) ** 2).sum() for r, s in zip(reference, start, strict=True))
    return (num / den).sqrt().item()


def deepspeed_run(config: dict, data, rank: int) -> tuple[dict, list[torch.Tensor]]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    model = mlp()
    start = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR), config=config)
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32
    ledgers = []
    for x, y in data:  # one ledger a step: the first traces stage 3's order, the last is steady
        with CommLedger() as ledger:
            for i in range(config["gradient_accumulation_steps"]):
                out = engine(x[i, rank].to(dtype))
                engine.backward(nn.functional.mse_loss(out.float(), y[i, rank]))
                engine.step()  # DeepSpeed steps the optimizer on the last micro-batch only
        ledgers.append(ledger)
    # the fp32 master weights the optimizer updates, whole (a collective at stage 3)
    weights = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    result = {
        "stage": engine.zero_optimization_stage(),
        "bf16": engine.bfloat16_enabled(),
        "optimizer": type(engine.optimizer).__name__,
        "hpz_partition_size": engine.zero_hpz_partition_size(),
        "cpu_offload": engine.zero_cpu_offload(),
        "global_steps": engine.global_steps,
        "seconds": time.perf_counter() - start,
        "last_step": [[r.op, r.dtype, r.numel, r.nbytes, r.sent_bytes]
                      for r in ledgers[-1].records],
        "sent_bytes": sum(ledger.total_bytes() for ledger in ledgers),
    }
    engine.destroy()
    return result, weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("configs", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    info = init_worker()  # gloo on a file store: DeepSpeed finds the group made and joins it
    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce at start-up (2 minutes
    # on 2 cores, cached after). Only `inference_all_reduce` uses it; training's collectives
    # are torch.distributed's, which the ledger sees. Without it DeepSpeed falls back to gloo.
    # (`deepspeed.comm.torch` as an attribute is torch itself, re-exported: hence sys.modules.)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (loads the module patched below)
    from deepspeed.utils import logger

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    logger.setLevel(logging.ERROR)  # rank-prefixed results only, no DeepSpeed banners
    deepspeed.init_distributed(dist_backend="gloo")

    runs = {}
    for path in args.configs:
        written = json.loads(path.read_text())
        fp32 = copy.deepcopy(written)
        fp32["bf16"] = {"enabled": False}
        k, micro = written["gradient_accumulation_steps"], written["train_micro_batch_size_per_gpu"]
        data = batches(args.steps, k, info.world_size, micro)
        clip = written["gradient_clipping"]
        start = [p.detach() for p in mlp().parameters()]
        reference = one_process(data, clip)
        # A run that dropped the other rank's half of the batch: how far a wrong run lands.
        wrong = one_process([(x[:, :1], y[:, :1]) for x, y in data], clip)
        for name, config in ((path.stem, written), (path.stem + "_fp32", fp32)):
            result, weights = deepspeed_run(config, data, info.rank)
            result["max_diff"] = max((w - r).abs().max().item()
                                     for w, r in zip(weights, reference, strict=True))
            result["update_error"] = relative_update_error(weights, reference, start)
            result["numels"] = [w.numel() for w in weights]
            if info.rank == 0:
                print(f"{name}: stage {result['stage']}, {result['optimizer']}, "
                      f"max |w - one process| = {result['max_diff']:.2e} "
                      f"(update error {result['update_error']:.2%}), "
                      f"{result['sent_bytes']:.0f} bytes sent, {result['seconds']:.1f} s",
                      flush=True)
            runs[name] = result
    report({"runs": runs, "world_size": info.world_size,
            "wrong_run": {"max_diff": max((w - r).abs().max().item()
                                          for w, r in zip(wrong, reference, strict=True)),
                          "update_error": relative_update_error(wrong, reference, start)}})


if __name__ == "__main__":
    main()
