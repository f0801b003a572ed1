"""Per-rank worker (2 gloo ranks) for tests/test_precision_masters.py and
tests/test_frozen_stage3.py: one launch for both.

- "fp32_reduce": bf16 with RMSNorms kept in fp32, SGD at lr 1, stages 0-3 (and stage 1
  reducing during backward, its last reductions left to the step), with
  reduce_dtype=torch.float32 and without: after one step of one or two backwards, is each
  fp32 master exactly w0 - the sum over backwards of the mean over ranks of the local
  gradients taken in fp32, the average FSDP2 keeps as the master's gradient?
- "round_trip": bf16, one Adam step, stages 0-3: does `model.load_state_dict(
  model.state_dict())` (stage 3: of `full_state_dict(model)`; its state_dict() is refused)
  leave the fp32 masters and the 16-bit weights exactly as they were?
- "reference_gap": the reviewer's comparison (issue 35, finding 14): one process with fp32
  masters against shard(precision="fp16", keep_fp32=(RMSNorm,), reduce_dtype=float32) after
  one SGD step at lr 0.01, on the embedding weight.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from zero_lab import checkpoint
from zero_lab.collectives import CommLedger
from zero_lab.launch import init_worker, report, scratch_folder
from zero_lab.stages import full_state_dict, shard
from zero_lab.stages.mixed_precision import mixed_precision_reference, to_compute_dtype

VOCAB, D, BATCH, SEQ = 64, 16, 8, 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.norm = nn.RMSNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.head = nn.Linear(2 * D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.up(self.norm(self.emb(idx)))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def mine(b, rank: int, world: int):
    per = BATCH // world
    return tuple(t[rank * per:(rank + 1) * per] for t in b)


def loss_of(model: nn.Module, b) -> torch.Tensor:
    x, y = b
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def averaged_local_grads(base: nn.Module, batches, world: int) -> dict[str, torch.Tensor]:
    """Per micro-batch, every rank's 16-bit local gradients (a twin computing as shard()'s
    model does) averaged over the ranks in fp32; summed over the micro-batches in fp32."""
    twin = copy.deepcopy(base)
    to_compute_dtype(twin, torch.bfloat16, keep_fp32=(nn.RMSNorm,))
    total: dict[str, torch.Tensor] = {}
    for b in batches:
        twin.zero_grad(set_to_none=True)
        loss_of(twin, b).backward()
        for name, p in twin.named_parameters():
            local = p.grad.float()
            every = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(every, local)
            avg = torch.stack(every).mean(0)
            total[name] = avg if name not in total else total[name] + avg
    return total


def fp32_reduce(rank: int, world: int) -> list[dict]:
    torch.manual_seed(0)
    base = Net()
    out = []
    overlap = {"overlap_grad_reduce": True, "overlap_step": True}  # stage 1's in-flight path
    for stage, options in ((0, {}), (1, {}), (1, overlap), (2, {}), (3, {})):
        for micro in (1, 2):
            for reduce_dtype in (torch.float32, None):
                model, opt = shard(copy.deepcopy(base), stage, sgd, precision="bf16",
                                   keep_fp32=(nn.RMSNorm,), reduce_dtype=reduce_dtype,
                                   bucket_mb=0.002, **options)
                before = full_state_dict(model)
                batches = [mine(batch(k), rank, world) for k in range(micro)]
                for b in batches:
                    loss_of(model, b).backward()
                opt.step()
                after = full_state_dict(model)
                grads = averaged_local_grads(base, batches, world)
                exact = {name: bool(torch.equal(after[name],
                                                before[name].add(grads[name], alpha=-1.0)))
                         for name in grads}
                out.append({"stage": stage, "micro": micro, "reduce": str(reduce_dtype),
                            "overlap": bool(options),
                            "exact": exact,
                            "max_diff": max((after[n] - before[n] + grads[n]).abs().max().item()
                                            for n in grads)})
    return out


def round_trip(rank: int, world: int) -> list[dict]:
    torch.manual_seed(1)
    base = Net()
    out = []
    for stage in range(4):
        model, opt = shard(copy.deepcopy(base), stage,
                           lambda ps: torch.optim.Adam(ps, lr=1e-3), precision="bf16")
        loss_of(model, mine(batch(0), rank, world)).backward()
        opt.step()
        opt.zero_grad()
        masters = full_state_dict(model)
        low = {n: p.data.clone() for n, p in model.named_parameters()}
        refused = ""
        if stage == 3:
            try:
                model.state_dict()
            except RuntimeError as exc:
                refused = str(exc)
            state = full_state_dict(model)
        else:
            state = model.state_dict()
        dtypes = sorted({str(t.dtype) for t in state.values()})
        model.load_state_dict(state)
        again = full_state_dict(model)
        out.append({"stage": stage, "refused": refused, "dtypes": dtypes,
                    "masters_exact": all(torch.equal(again[n], masters[n]) for n in masters),
                    "max_diff": max((again[n] - masters[n]).abs().max().item() for n in masters),
                    "low_exact": all(torch.equal(p.data, low[n])
                                     for n, p in model.named_parameters())})
    return out


def reference_gap(rank: int, world: int) -> list[dict]:
    """The reviewer's comparison, stages 0-3: the embedding weight after one SGD step at lr
    0.01 in fp16 (RMSNorm kept fp32, reduce_dtype=float32) against one process with fp32
    masters on the global batch: the fp32 masters (full_state_dict), the 16-bit weights the
    model computes with, and model.state_dict() (stages 0-2); beside them, how far the
    reference's own master is from its fp16 rounding."""
    torch.manual_seed(2)
    base = Net()
    b = batch(0)
    ref, ref_opt = mixed_precision_reference(copy.deepcopy(base), lambda ps: torch.optim.SGD(
        ps, lr=0.01), torch.float16, keep_fp32=(nn.RMSNorm,))
    loss_of(ref, b).backward()
    ref_opt.step()
    want = ref_opt.full_state_dict(ref)["emb.weight"]
    out = []
    for stage in range(4):
        model, opt = shard(copy.deepcopy(base), stage, lambda ps: torch.optim.SGD(ps, lr=0.01),
                           precision="fp16", keep_fp32=(nn.RMSNorm,),
                           reduce_dtype=torch.float32)
        loss_of(model, mine(b, rank, world)).backward()
        opt.step()
        masters = full_state_dict(model)["emb.weight"]
        row = {"stage": stage, "masters": (masters - want).abs().max().item(),
               "rounding": (want.half().float() - want).abs().max().item()}
        if stage < 3:
            row["low"] = (model.emb.weight.float() - want).abs().max().item()
            row["state_dict"] = (model.state_dict()["emb.weight"].float() - want
                                 ).abs().max().item()
        out.append(row)
    return out


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank adapter B(A(x)), as LoRA."""

    def __init__(self, d: int, r: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.a = nn.Linear(d, r, bias=False)
        self.b = nn.Linear(r, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


class LoRANet(nn.Module):
    """Two LoRA blocks (the second's input needs a gradient: its frozen base is used by
    backward after its adapter's gradients are in), a frozen input projection at the root
    beside a trainable root gain, a trainable head. d = 33: nothing divides evenly."""

    def __init__(self, d: int = 33) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.proj.requires_grad_(False)
        self.gain = nn.Parameter(torch.ones(d))
        self.blocks = nn.ModuleList([LoRALinear(d), LoRALinear(d)])
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) * self.gain
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def lora_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(BATCH, 33, generator=g), torch.randn(BATCH, 3, generator=g)


def frozen_stage3(rank: int, world: int) -> dict:
    """LoRANet at stage 3, 3 steps of Adam: the frozen parameters' bytes at rest, the
    weights against one process on the global batch, and one step's collectives."""
    torch.manual_seed(3)
    base = LoRANet()
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    model, opt = shard(copy.deepcopy(base), 3, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    mse = nn.functional.mse_loss
    for step in range(3):
        x, y = lora_batch(step)
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 2:  # the last step under the ledger
            ledger = CommLedger().__enter__()
        xl, yl = mine((x, y), rank, world)
        mse(model(xl), yl).backward()
        opt.step()
        opt.zero_grad()
    ledger.__exit__(None, None, None)
    storages = {}  # the frozen parameters' memory at rest on this rank, per module
    for name, p in model.named_parameters():
        if not p.requires_grad:
            module = name.rsplit(".", 1)[0]
            storage = p.untyped_storage()
            storages.setdefault(module, {})[storage.data_ptr()] = storage.nbytes()
    full, want = full_state_dict(model), ref.state_dict()
    units = [{"unit": u.name, "trainable_padded": u.group.padded_numel,
              "frozen_padded": u.frozen.group.padded_numel if u.frozen else 0,
              "frozen_numel": u.frozen.group.numel if u.frozen else 0}
             for u in opt.sync.units]
    # zero_lab.checkpoint: the frozen pieces saved whole, loaded back as this rank's pieces
    where = scratch_folder("frozen_ckpt")
    checkpoint.save(model, opt, where / "ckpt", step=3)
    torch.manual_seed(4)  # another initialisation, overwritten by the load
    other, other_opt = shard(LoRANet(), 3, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    checkpoint.load(other, other_opt, where / "ckpt")
    loaded = full_state_dict(other)
    whole = checkpoint.consolidate(where / "ckpt")
    # model.load_state_dict of the full weights: each rank keeps its piece of every parameter
    torch.manual_seed(5)
    third, _ = shard(LoRANet(), 3, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    third.load_state_dict(full)
    from_dict = full_state_dict(third)
    return {"checkpoint_exact": all(torch.equal(loaded[k], full[k]) for k in full),
            "load_state_dict_exact": all(torch.equal(from_dict[k], full[k]) for k in full),
            "consolidated_exact": all(torch.equal(whole[k], full[k]) for k in full),
            "at_rest": {m: sum(b.values()) for m, b in storages.items()},
            "frozen_numel": {m: sum(p.numel() for p in base.get_submodule(m).parameters())
                             for m in storages},
            "max_diff": max((full[k] - want[k]).abs().max().item() for k in want),
            "frozen_unchanged": all(torch.equal(full[n], base.state_dict()[n])
                                    for n, p in base.named_parameters() if not p.requires_grad),
            "units": units, "ledger": ledger.signature(),
            "gathered_after": opt.sync.gathered_bytes()}


PARTS = {"fp32_reduce": fp32_reduce, "round_trip": round_trip, "reference_gap": reference_gap,
         "frozen_stage3": frozen_stage3}


def run(rank: int, world: int) -> dict:
    """Every part (tests/workers/world_cases.py runs them at N = 2)."""
    return {key: part(rank, world) for key, part in PARTS.items()}


def main() -> None:
    """This worker alone, to debug it: torchrun(this file, nproc=2)."""
    info = init_worker()
    report(run(info.rank, info.world_size))


if __name__ == "__main__":
    main()
