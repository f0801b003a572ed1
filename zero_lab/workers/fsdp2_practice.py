"""Notebook 09, FSDP2 in practice: torch's `fully_shard` on the course's TinyGPT, on every rank.

    fsdp2_practice.py --part train  --folder DIR   # 2 ranks: everything below, a DCP save
    fsdp2_practice.py --part resume --folder DIR   # 3 ranks: load that save, train on

`--part train` reports, each under its own key:
- "wrap": every parameter as FSDP2 holds it after `fully_shard` on each block, then the root
  (global and local shapes, placements, the padded local storage), and the groups;
- "meta": a model built on the meta device: tied or not after `to_empty()` without FSDP2 and
  with it, what a forward on meta parameters raises, and the weights after loading a full
  state dict broadcast from rank 0 against one process's initialisation;
- "ledger": the collectives of one step under each configuration of CONFIGS (CommLedger), with
  each group's parameter bytes;
- "clip": `clip_grad_norm_`'s total norm and the norm of this rank's local shards;
- "train": the weights after STEPS steps of FSDP2, of `shard(model, 3)` and of one process on
  the global batch (compared in the notebook), saving a DCP checkpoint at step SAVE_AT and a
  full state dict for a single process.
`--part resume` loads the step-SAVE_AT checkpoint on 3 ranks, trains to STEPS and reports the
weights. Under NCCL the train part also records a CUDA memory snapshot ("cuda").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)

from zero_lab import checkpoint
from zero_lab.collectives import CommLedger
from zero_lab.course.fsdp2_configs import (
    ACCUMULATION_K,
    CONFIGS,
    GLOBAL_BATCH,
    LR,
    MODEL,
    SAVE_AT,
    STEPS,
)
from zero_lab.course.workloads import TinyGPT, gpt_batch, next_token_loss, rank_slice
from zero_lab.launch import init_worker, report
from zero_lab.measure.memory import held_bytes
from zero_lab.stages import full_state_dict, shard


def seeded_model(device: torch.device) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(**MODEL).to(device)


def wrap(model: TinyGPT, norm_policy: MixedPrecisionPolicy | None = None, **kwargs) -> TinyGPT:
    """fully_shard bottom-up, as torchtitan does: each block its own group, then the root.
    With `norm_policy`, every LayerNorm first gets a call (a group) of its own with it."""
    if norm_policy is not None:
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                fully_shard(module, mp_policy=norm_policy)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt_batch(step, GLOBAL_BATCH, MODEL["seq_len"], MODEL["vocab_size"], device=device)


def local_batch(step: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    return rank_slice(batch(step, device), dist.get_rank(), dist.get_world_size())


def groups(model: nn.Module) -> list[dict]:
    """Each FSDP2 group: its module's name and the bytes of its parameters (whole)."""
    out, names = [], {id(p): n for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group  # noqa: SLF001 - see below
            # torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: the parameters this
            # fully_shard call manages, each an FSDPParam with its padded sharded storage
            params = group.fsdp_params if group is not None else []
            # the dtypes it gathers and reduces in, from its policy as FSDPParam's
            # init_dtype_attrs reads it: None = the parameter's own; reduce = as gathered
            policy = module._get_fsdp_state()._mp_policy  # noqa: SLF001
            gather = [policy.param_dtype or p.sharded_param.dtype for p in params]
            reduce = [policy.reduce_dtype or g for g in gather]
            out.append({"module": name or "(root)",
                        "params": [names[id(p.sharded_param)] for p in params],
                        "gather_bytes": gather[0].itemsize if gather else 0,
                        "reduce_bytes": reduce[0].itemsize if reduce else 0,
                        "numel": sum(p._orig_size.numel() for p in params),
                        "padded_local": sum(p._sharded_param_data.numel() for p in params)})
    return out


def wrap_facts(device: torch.device) -> dict:
    model = wrap(seeded_model(device))
    params = [{"name": n, "global": list(p.shape), "local": list(p.to_local().shape),
               "placements": str(p.placements), "type": type(p).__name__}
              for n, p in model.named_parameters()]
    return {"class": [c.__name__ for c in type(model).__mro__[:3]], "params": params,
            "groups": groups(model)}


def norms_without_output_dtype(device: torch.device) -> str:
    """fp32 norms inside bf16 blocks, without output_dtype: what the forward raises."""
    policy = CONFIGS["bf16, norms in fp32"]
    norm = MixedPrecisionPolicy(param_dtype=torch.float32)  # no output_dtype
    model = wrap(seeded_model(device), norm_policy=norm, mp_policy=policy["mp_policy"])
    try:
        one_step(model, device)
        return "no error"
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"


def meta_facts(device: torch.device) -> dict:
    with torch.device("meta"):
        plain = TinyGPT(**MODEL)
    plain.to_empty(device=device)
    with torch.device("meta"):
        model = wrap(TinyGPT(**MODEL))
    try:
        model(batch(0, device)[0][:1])
        meta_forward = "no error"
    except Exception as exc:  # noqa: BLE001 - reported: what a learner sees
        meta_forward = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    model.to_empty(device=device)
    reference = seeded_model(device).state_dict()
    uninitialised = max((full - reference[n]).abs().max().item()
                        for n, full in full_state_dict_of(model).items())
    # Rank 0 holds the full initial weights (from a checkpoint, or built on CPU); the others
    # pass nothing: broadcast_from_rank0 sends each rank its shards.
    full = seeded_model(device).state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    loaded = max((full_ - reference[n]).abs().max().item()
                 for n, full_ in full_state_dict_of(model).items())
    return {"plain_tied": plain.head.weight is plain.tok_emb.weight,
            "plain_numel": sum(p.numel() for p in plain.parameters()),
            "fsdp2_tied": model.head.weight is model.tok_emb.weight,
            "fsdp2_numel": sum(p.numel() for p in model.parameters()),
            "meta_forward": meta_forward, "uninitialised_max_diff": uninitialised,
            "loaded_max_diff": loaded}


def full_state_dict_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of an FSDP2 model, on every rank (all-gathered)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def one_step(model: nn.Module, device: torch.device, step: int = 0, k: int = 1) -> None:
    """Forward and backward of `step`'s local batch in k micro-batches, gradient sync (and
    resharding after backward) off for the first k - 1 (set_requires_gradient_sync)."""
    parts = [t.chunk(k) for t in local_batch(step, device)]
    for i in range(k):
        last = i == k - 1
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        (next_token_loss(model, tuple(p[i] for p in parts)) / k).backward()


def ledger_facts(device: torch.device) -> list[dict]:
    runs = []
    for name, kwargs in CONFIGS.items():
        model = wrap(seeded_model(device), **kwargs)
        with CommLedger() as ledger:
            one_step(model, device)
        runs.append({"config": name, "k": 1, "groups": groups(model),
                     "comm": [[r.op, r.nbytes] for r in ledger.records]})
    model = wrap(seeded_model(device))
    with CommLedger() as ledger:
        one_step(model, device, k=ACCUMULATION_K)
    runs.append({"config": "default", "k": ACCUMULATION_K, "groups": groups(model),
                 "comm": [[r.op, r.nbytes] for r in ledger.records]})
    return runs


def memory_facts(device: torch.device) -> dict:
    """What this rank holds mid-step (Adam's states made, gradients just computed), by
    category, beside the storage FSDP2 sized: padded shards, and the shards without padding."""
    model = wrap(seeded_model(device))
    optimizer = adamw(model.parameters())
    train_steps(model, optimizer, device, range(1))
    next_token_loss(model, local_batch(1, device)).backward()
    return {"held": held_bytes(model, optimizer),
            "padded_local": sum(g["padded_local"] for g in groups(model)),
            "local": sum(p.to_local().numel() for p in model.parameters()),
            "numel": sum(p.numel() for p in model.parameters())}


def clip_facts(device: torch.device) -> dict:
    model = wrap(seeded_model(device))
    one_step(model, device)
    local = torch.stack([p.grad.to_local().norm() for p in model.parameters()]).norm().item()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    return {"total_type": type(total).__name__, "total": float(total.full_tensor()),
            "local_shard_norm": local}


def one_process_clip_norm(device: torch.device) -> float:
    """The gradient norm of one process on the global batch (the notebook compares)."""
    model = seeded_model(device)
    next_token_loss(model, batch(0, device)).backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()


def train_steps(model: nn.Module, optimizer, device: torch.device, steps: range) -> None:
    for step in steps:
        next_token_loss(model, local_batch(step, device)).backward()
        optimizer.step()
        optimizer.zero_grad()


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def train_facts(device: torch.device, folder: Path) -> dict:
    model = wrap(seeded_model(device))
    optimizer = adamw(model.parameters())
    train_steps(model, optimizer, device, range(SAVE_AT))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    started = time.perf_counter()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder / f"step{SAVE_AT}")
    save_s = time.perf_counter() - started
    train_steps(model, optimizer, device, range(SAVE_AT, STEPS))
    fsdp2 = full_state_dict_of(model)
    # Out to a single process: every shard gathered to rank 0's CPU, one torch.save.
    single = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(single, folder / "full_state_dict.pt")
    zero3, zero3_opt = shard(seeded_model(device), 3, adamw)
    train_steps(zero3, zero3_opt, device, range(STEPS))
    ours = full_state_dict(zero3)
    started = time.perf_counter()
    checkpoint.save(zero3, zero3_opt, folder / "course", step=STEPS)
    course_save_s = time.perf_counter() - started
    one = seeded_model(device)
    one_opt = adamw(one.parameters())
    for step in range(STEPS):
        next_token_loss(one, batch(step, device)).backward()
        one_opt.step()
        one_opt.zero_grad()
    reference = one.state_dict()
    return {"fsdp2_vs_one": max_diff(fsdp2, reference),
            "zero3_vs_one": max_diff(ours, reference),
            "fsdp2_vs_zero3": max_diff(fsdp2, ours),
            "saved": {"DCP": on_disk(folder / f"step{SAVE_AT}", save_s),
                      "zero_lab.checkpoint": on_disk(folder / "course", course_save_s)},
            "weights": digest(fsdp2) if dist.get_rank() == 0 else None}


def resume_facts(device: torch.device, folder: Path) -> dict:
    model = wrap(seeded_model(device))
    optimizer = adamw(model.parameters())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder / f"step{SAVE_AT}")  # resharded to 3 ranks here
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    train_steps(model, optimizer, device, range(SAVE_AT, STEPS))
    weights = full_state_dict_of(model)
    return {"weights": digest(weights) if dist.get_rank() == 0 else None,
            "wrap": {"groups": groups(model)}, "memory": memory_facts(device)}


def on_disk(path: Path, seconds: float) -> dict:
    """A checkpoint's files and bytes (after a barrier: every rank's files are written)."""
    dist.barrier()
    files = [f for f in path.resolve().rglob("*") if f.is_file()]
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "save_s": seconds}


def max_diff(a: dict, b: dict) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() for n in b)


def digest(weights: dict) -> dict[str, list[float]]:
    """Every weight, flattened (the model is tiny: ~27k numbers)."""
    return {n: t.detach().float().reshape(-1).tolist() for n, t in weights.items()}


def cuda_facts(device: torch.device, folder: Path) -> dict:
    """One FSDP2 step under the CUDA allocator's history: the snapshot file (open it at
    https://pytorch.org/memory_viz), allocated against reserved bytes, and how much of it is
    the model's states (`held_bytes`) against what was allocated before the model existed
    (the earlier parts' models are gone by then: what stays is the CUDA libraries' own)."""
    torch.cuda.synchronize(device)
    before_model = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=100_000)  # noqa: SLF001 - documented
    model = wrap(seeded_model(device))
    optimizer = adamw(model.parameters())
    torch.cuda.reset_peak_memory_stats(device)
    train_steps(model, optimizer, device, range(1))
    path = folder / f"memory_snapshot_rank{dist.get_rank()}.pickle"
    torch.cuda.memory._dump_snapshot(str(path))  # noqa: SLF001
    torch.cuda.memory._record_memory_history(enabled=None)  # noqa: SLF001
    facts = {"snapshot": str(path), "allocated": torch.cuda.memory_allocated(device),
             "reserved": torch.cuda.memory_reserved(device),
             "peak_allocated": torch.cuda.max_memory_allocated(device),
             "before_model": before_model,
             "model_states": held_bytes(model, optimizer)["total"]}
    for name, kwargs in (("on GPU", {}), ("CPUOffloadPolicy", {"offload_policy":
                                                               CPUOffloadPolicy()})):
        model = wrap(seeded_model(device), **kwargs)
        optimizer = adamw(model.parameters())
        train_steps(model, optimizer, device, range(2))  # warm-up
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        train_steps(model, optimizer, device, range(2, 6))
        torch.cuda.synchronize(device)
        facts[f"step_s {name}"] = (time.perf_counter() - started) / 4
    return facts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("train", "resume"), required=True)
    parser.add_argument("--folder", type=Path, required=True)
    args = parser.parse_args(argv)
    info = init_worker()
    device = info.device
    if args.part == "resume":
        report({"world_size": info.world_size, "resume": resume_facts(device, args.folder)})
        return
    out = {"world_size": info.world_size, "wrap": wrap_facts(device),
           "meta": meta_facts(device), "ledger": ledger_facts(device),
           "clip": clip_facts(device), "memory": memory_facts(device),
           "norms_without_output_dtype": norms_without_output_dtype(device),
           "train": train_facts(device, args.folder)}
    if info.rank == 0:
        out["one_process_norm"] = one_process_clip_norm(device)
    if device.type == "cuda":
        out["cuda"] = cuda_facts(device, args.folder)
    report(out)


if __name__ == "__main__":
    main()
