"""Per-rank worker for tests/test_finding_frozen_offload_fp32.py (issue 48, part 4): three
claims of notebooks 05, 08 and 09 about FSDP2 beside the course's stage 3, measured on gloo.

- frozen: a block whose parameters are all frozen (a LoRA base left without an adapter). The
  course's stage 3 makes no unit of it: its parameters join the root unit when the root holds
  a trainable parameter of its own (`unit_classes` leaves the head to the root), and otherwise
  stay whole on every rank. FSDP2's `fully_shard(block)` shards it like any block.
- offload: FSDP2's `CPUOffloadPolicy` on CPU-only ranks, with `pin_memory` True (refused:
  pinning needs an accelerator) and False (trains, the same weights as without offload).
- accumulation: FSDP2 with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` under
  `set_requires_gradient_sync(False)`: the unsharded gradient each rank holds between
  micro-batches, its dtype and bytes (FSDPParam.unsharded_accumulated_grad, torch 2.13's
  _fsdp_param.py to_accumulated_grad_if_needed), beside the bf16 one without reduce_dtype.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from zero_lab.launch import init_worker, report
from zero_lab.stages import shard

D, BATCH = 64, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Net(nn.Module):
    """Three blocks and a head; block 0 wholly frozen (frozen_first)."""

    def __init__(self, frozen_first: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(D, 1)
        if frozen_first:
            self.blocks[0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(seed: int = 0, frozen_first: bool = True) -> Net:
    torch.manual_seed(seed)
    return Net(frozen_first)


def batch(step: int, rank: int) -> torch.Tensor:
    torch.manual_seed(100 + 10 * step + rank)
    return torch.randn(BATCH, D)


def fsdp2(model: nn.Module, **kwargs) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def frozen(rank: int, world: int) -> dict:
    """Elements of the frozen block's weight this rank holds at rest, after one step."""
    out = {"numel": D * D}
    cases = (("course default", {}), ("course unit_classes", {"unit_classes": [Block]}))
    for label, kwargs in cases:
        model, opt = shard(make(), 3, lambda ps: torch.optim.Adam(ps, lr=1e-3), **kwargs)
        model(batch(0, rank)).square().mean().backward()
        opt.step()
        out[label] = model.blocks[0].fc.weight.data.numel()
        out[label + ": units holding frozen parameters"] = [
            u.name for u in opt.sync.units if u.frozen is not None]
    model = fsdp2(make())
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(batch(0, rank)).square().mean().backward()
    opt.step()
    out["fsdp2"] = model.blocks[0].fc.weight.to_local().numel()
    return out


def offload(rank: int, world: int) -> dict:
    """CPUOffloadPolicy on CPU: the error with pin_memory=True; with False, 3 steps of Adam
    against the same model without offload."""
    out = {}
    try:
        fsdp2(make(frozen_first=False), offload_policy=CPUOffloadPolicy())
        out["pinned"] = "ran"
    except Exception as exc:  # noqa: BLE001 - the refusal is what is measured
        out["pinned"] = f"{type(exc).__name__}: {exc}"
    weights = {}
    for label, kwargs in (("offload", {"offload_policy": CPUOffloadPolicy(pin_memory=False)}),
                          ("plain", {})):
        model = fsdp2(make(frozen_first=False), **kwargs)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(3):
            model(batch(step, rank)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        weights[label] = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["max_diff"] = max((weights["offload"][n] - weights["plain"][n]).abs().max().item()
                          for n in weights["plain"])
    out["moved"] = max((weights["plain"][n] - make(frozen_first=False).state_dict()[n])
                       .abs().max().item() for n in weights["plain"])
    return out


def held_gradient(rank: int, world: int) -> dict:
    """Bytes of unsharded gradient each rank holds after one backward without sync, for
    reduce_dtype=float32 and None (param_dtype=bfloat16 both)."""
    out = {"psi": sum(p.numel() for p in make(frozen_first=False).parameters())}
    for label, reduce_dtype in (("fp32", torch.float32), ("none", None)):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        model = fsdp2(make(frozen_first=False), mp_policy=policy)
        model.set_requires_gradient_sync(False)
        model(batch(0, rank)).float().square().mean().backward()
        held, dtypes = 0, set()
        for module in [*model.blocks, model]:
            group = module._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params:
                grad = fp.unsharded_accumulated_grad
                if grad is None:
                    grad = fp._unsharded_param.grad
                if grad is not None:
                    held += grad.numel() * grad.element_size()
                    dtypes.add(str(grad.dtype))
        out[label] = {"bytes": held, "dtypes": sorted(dtypes)}
    return out


PARTS = {"frozen": frozen, "offload": offload, "held_gradient": held_gradient}


def run(rank: int, world: int) -> dict:
    """Every part (tests/workers/world_cases.py runs them at N = 2)."""
    return {key: part(rank, world) for key, part in PARTS.items()}


def main() -> None:
    """This worker alone, to debug it: torchrun(this file, nproc=2)."""
    info = init_worker()
    report(run(info.rank, info.world_size))


if __name__ == "__main__":
    main()
