"""FSDP2 training, torch only: the script to take to work (notebook 09). A tiny causal LM on a
synthetic task: swap in your model, data and loss. A GPU a rank under NCCL, else CPU and gloo.

    torchrun --nproc-per-node 2 fsdp2_train.py --steps 8 --save-at 4 --ckpt ckpt
    torchrun --nproc-per-node 3 fsdp2_train.py --steps 8 --resume ckpt   # another world size
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

VOCAB, SEQ, BATCH, LR = 64, 32, 24, 3e-3  # BATCH: the global batch, split over the ranks


class TinyLM(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(  # dropout 0: nothing random
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True, bias=False)
            for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d, bias=False), nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], x.device, x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def batch(step: int, rank: int, world: int, device: torch.device):
    """This rank's rows of the step's global batch, the same at any world size (a sampler's
    job): each row counts up from a random token in strides of 1-3, a pattern to learn."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    rows = ((start + stride * torch.arange(SEQ + 1)) % VOCAB).chunk(world)[rank].to(device)
    return rows[:, :-1], rows[:, 1:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accum", type=int, default=2, help="micro-batches a step")
    p.add_argument("--save-at", type=int, help="after this step, save a checkpoint to --ckpt")
    p.add_argument("--ckpt")
    p.add_argument("--resume", help="a checkpoint folder, saved on any number of ranks")
    p.add_argument("--out", help="rank 0 saves the final full weights here, for one process")
    p.add_argument("--init-method", default="env://", help="file://PATH: meet on a file, no port")
    args = p.parse_args()

    cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before the mesh: NCCL binds this rank's GPU
    dist.init_process_group("nccl" if cuda else "gloo", init_method=args.init_method,
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % (world * args.accum):  # else a rank's micro-batches differ in number or size
        raise SystemExit(f"{BATCH} rows do not split into {world} ranks x {args.accum}")
    mesh = init_device_mesh(device.type, (world,))  # 1-D: FSDP2 shards over every rank

    with torch.device("meta"):  # shapes, no memory: however big the model
        model = TinyLM()
    # A group per block, gathered only around its compute, then the root: it takes what no
    # block holds. Gathers and compute in bf16; gradients reduced in fp32; shards stay fp32.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)  # each rank allocates its own shards, uninitialised
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # steps the fp32 shards
    first = 0
    if args.resume:  # each rank reads the pieces its shards need, whoever saved them
        model_sd, optim_sd = dsd.get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        dcp.load(state, checkpoint_id=args.resume)
        dsd.set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        first = state["step"]
    else:  # rank 0 builds the initial weights once, on CPU; each rank receives its shards
        torch.manual_seed(0)
        full = TinyLM().state_dict() if rank == 0 else {}
        dsd.set_model_state_dict(model, full, options=dsd.StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))

    for step in range(first, args.steps):
        began, total = time.perf_counter(), torch.zeros((), device=device)
        x, y = batch(step, rank, world, device)
        for i, (xm, ym) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum), strict=True)):
            # Before the last micro-batch: no reduce-scatter (gradients add up unsharded, in
            # fp32) and no reshard (the next forward gathers nothing). Both back on for the
            # last: left off, no gradient reaches the shards, or the next step computes with
            # the gathered pre-step weights. Memory tight? Drop both: each backward then sends.
            last = i == args.accum - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            logits = model(xm).float()  # out in bf16: the softmax in fp32
            loss = F.cross_entropy(logits.flatten(0, 1), ym.flatten()) / args.accum
            loss.backward()
            total += loss.detach()
        # On DTensor gradients: the whole model's norm, the same on every rank.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0).full_tensor()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)  # the loss of the whole global batch
        loss_value, seconds = total.item(), time.perf_counter() - began
        if rank == 0:
            print(f"step {step + 1} loss {loss_value:.4f} grad_norm {norm.item():.4f} "
                  f"tokens/s {BATCH * SEQ / seconds:,.0f}", flush=True)
        if step + 1 == args.save_at:  # each rank writes its shards; one .metadata names all
            model_sd, optim_sd = dsd.get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd, "step": step + 1},
                     checkpoint_id=args.ckpt)

    if args.out:  # gathered on rank 0's CPU: loads into the plain model, in one process
        full = dsd.get_model_state_dict(model, options=dsd.StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, args.out)


if __name__ == "__main__":
    main()
    # Shut down while Python is whole: left to its exit, gloo's threads still letting go of
    # the last collectives' tensors (and FSDP2's reference cycles) can abort a rank.
    dist.barrier()  # the ranks end together
    gc.collect()
    dist.destroy_process_group()
