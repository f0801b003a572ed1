"""Per-rank worker (2 gloo ranks) for tests/test_grad_after_backward.py: one launch for both
parts.

- "grads": what a user reads after `loss.backward()` (to clip, log, or in a hook), at stages
  0-3 under every precision policy (fp32; bf16 and fp16, each with and without RMSNorms kept
  in fp32 and with and without reduce_dtype=torch.float32), after one backward and after two
  (accumulation), stage 3 with root_params "shard" and "replicate". The model is CS336's
  FSDP toy (an embedding, RMSNorms of its own, Linears), cut as CS336's FSDP cuts it
  (unit_classes=(nn.Linear, nn.Embedding)): at stage 3 its norms are the parameters no unit
  claims. Each rank reports, per parameter it holds whole, its `.grad`'s distance from the
  average of every rank's local gradient (computed in this process by a twin that computes
  as shard()'s model does) and the `.grad` itself, for the test to compare across ranks;
  per flat group, the distance of the gradient the step uses (this rank's slice of it)
  from the same average.
- "wrapped": shard() of a model wrapped by torch's DistributedDataParallel, by FSDP1's
  FullyShardedDataParallel, or holding FSDP2 fully_shard modules: the refusals' messages.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from zero_lab.launch import init_worker, report
from zero_lab.stages import shard
from zero_lab.stages.mixed_precision import COMPUTE_DTYPES, step_grad, to_compute_dtype

VOCAB, D, FF, BATCH, SEQ = 29, 9, 13, 8, 5  # odd sizes: every flat group is padded at N = 2


class RMSNorm(nn.Module):
    """CS336's RMSNorm: reduces in fp32, hands back its input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
                * self.weight).to(in_dtype)


class Toy(nn.Module):
    """CS336's ToyFSDPModel, smaller: Embedding and Linears (sharded by CS336's FSDP) and
    two RMSNorms (replicated by it)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D)
        self.norm1 = RMSNorm(D)
        self.linear1 = nn.Linear(D, FF, bias=False)
        self.norm2 = RMSNorm(FF)
        self.linear2 = nn.Linear(FF, D, bias=False)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm2(torch.relu(self.linear1(self.norm1(self.embedding(x)))))
        return self.lm_head(self.linear2(x))


UNIT_CLASSES = (nn.Linear, nn.Embedding)  # as CS336's FSDP: the norms are left to the root
ROOT_PARAMS = ["norm1.weight", "norm2.weight"]  # what no unit claims


def policies() -> list[dict]:
    """fp32, and for bf16 and fp16 every combination of keep_fp32 and reduce_dtype."""
    out = [{"precision": "fp32", "keep_fp32": (), "reduce_dtype": None}]
    for precision in ("bf16", "fp16"):
        for keep in ((), (RMSNorm,)):
            for reduce_dtype in (None, torch.float32):
                out.append({"precision": precision, "keep_fp32": keep,
                            "reduce_dtype": reduce_dtype})
    return out


def describe(policy: dict) -> str:
    keep = "+keep_norms" if policy["keep_fp32"] else ""
    reduce = "+reduce_fp32" if policy["reduce_dtype"] is not None else ""
    return f"{policy['precision']}{keep}{reduce}"


def batch(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch `micro`: different data on every rank, so the local
    gradients differ and only the average is the same everywhere."""
    g = torch.Generator().manual_seed(1000 * micro + rank)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH,), generator=g))


def loss_of(model: nn.Module, b) -> torch.Tensor:
    x, y = b
    return nn.functional.cross_entropy(model(x)[:, -1, :].float(), y)


def reference(base: nn.Module, policy: dict, world: int, micros: int):
    """One process: a twin computing as shard()'s model does (16-bit, norms kept fp32 if
    asked), every rank's local gradients of every micro-batch in fp32; returns
    ({name: sum over micro-batches of the mean over ranks}, {name: the same sum of the mean
    of |local|}: the scale a rounding is measured against), and {name: compute dtype}."""
    twin = copy.deepcopy(base)
    dtype = COMPUTE_DTYPES.get(policy["precision"])
    if dtype is not None:
        to_compute_dtype(twin, dtype, keep_fp32=policy["keep_fp32"])
    avg: dict[str, torch.Tensor] = {}
    scale: dict[str, torch.Tensor] = {}
    for m in range(micros):
        locals_ = []
        for r in range(world):
            twin.zero_grad(set_to_none=True)
            loss_of(twin, batch(r, m)).backward()
            locals_.append({n: p.grad.float() for n, p in twin.named_parameters()})
        for n, _ in twin.named_parameters():
            every = torch.stack([grads[n] for grads in locals_])
            avg[n] = avg.get(n, 0) + every.mean(0)
            scale[n] = scale.get(n, 0) + every.abs().mean(0)
    return avg, scale, {n: p.dtype for n, p in twin.named_parameters()}


def tolerance(scale: torch.Tensor, dtype: torch.dtype) -> float:
    """A few roundings in `dtype` (the dtype the local gradient was computed in) of the
    largest gradient summed: what reducing and rounding 16-bit gradients may move an
    element by. A rank's local gradient instead of the average is off by the spread of
    the ranks' gradients, orders of magnitude more."""
    return 4 * torch.finfo(dtype).eps * scale.max().item()


def grads_case(rank: int, world: int, base: nn.Module, stage: int, policy: dict,
               micros: int, root_params: str | None) -> dict:
    options = {"unit_classes": UNIT_CLASSES, "root_params": root_params} if stage == 3 else {}
    model, opt = shard(copy.deepcopy(base), stage, lambda ps: torch.optim.SGD(ps, lr=0.1),
                       precision=policy["precision"], keep_fp32=policy["keep_fp32"],
                       reduce_dtype=policy["reduce_dtype"], bucket_mb=0.0001, **options)
    for m in range(micros):
        loss_of(model, batch(rank, m)).backward()
    avg, scale, dtypes = reference(base, policy, world, micros)
    sync = opt.sync
    names = {id(p): n for n, p in model.named_parameters()}
    whole, grads_seen, step_seen = {}, {}, []
    for g, group in enumerate(sync.groups):
        tol = max(tolerance(scale[names[id(p)]], dtypes[names[id(p)]]) for p in group.params)
        # the gradient the step uses, this rank's slice of it (the whole at stage 0 and for
        # a replicated unit), against the same slice of the average
        want = group.flatten([avg[names[id(p)]] for p in group.params], torch.float32)
        if sync.group_sharded(g):
            want = group.shard(want)
        used = step_grad(sync, g)
        step_seen.append({"params": [names[id(p)] for p in group.params],
                          "diff": (used.float() - want).abs().max().item(), "tol": tol})
        if sync.group_sharded(g):
            continue
        for p in group.params:  # held whole: what the user reads is the average
            n = names[id(p)]
            whole[n] = {"shape": list(p.grad.shape), "dtype": str(p.grad.dtype),
                        "diff": (p.grad.float() - avg[n]).abs().max().item(),
                        "tol": tolerance(scale[n], dtypes[n])}
            grads_seen[n] = p.grad.float().flatten().tolist()
    return {"name": f"stage {stage} {describe(policy)} x{micros}"
                    + (f" root={root_params}" if root_params else ""),
            "stage": stage, "root_params": root_params, "keep": bool(policy["keep_fp32"]),
            "whole": whole, "grads": grads_seen, "step": step_seen}


def grads(rank: int, world: int) -> list[dict]:
    torch.manual_seed(0)
    base = Toy()
    out = []
    for stage in range(4):
        for root_params in (("shard", "replicate") if stage == 3 else (None,)):
            for policy in policies():
                for micros in (1, 2):
                    out.append(grads_case(rank, world, base, stage, policy, micros,
                                          root_params))
    return out


def message(make) -> str:
    """What shard() raises on what `make` builds (type: message), or 'accepted'. Any
    exception: without the refusal, some of these failed deep inside shard() instead."""
    try:
        shard(make(), 0)
    except Exception as exc:  # noqa: BLE001 - reported whole, compared by the test
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def wrapped() -> dict[str, str]:
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    def fsdp2_inside() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fully_shard(model[1])
        return model

    return {
        "ddp": message(lambda: DistributedDataParallel(nn.Linear(4, 2))),
        "ddp_inside": message(lambda: nn.Sequential(
            nn.Linear(4, 4), DistributedDataParallel(nn.Linear(4, 2)))),
        "fsdp1": message(lambda: FullyShardedDataParallel(nn.Linear(4, 2),
                                                          device_id=torch.device("cpu"))),
        "fsdp2": message(lambda: fully_shard(nn.Sequential(nn.Linear(4, 4),
                                                           nn.Linear(4, 2)))),
        "fsdp2_inside": message(fsdp2_inside),
    }


def run(rank: int, world: int) -> dict:
    """Both parts (tests/workers/world_cases.py runs them at N = 2)."""
    return {"grads": grads(rank, world), "wrapped": wrapped()}


if __name__ == "__main__":  # this worker alone, to debug it: torchrun(this file, nproc=2)
    info = init_worker()
    report(run(info.rank, info.world_size))
