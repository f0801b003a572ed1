"""Test worker for tests/test_cuda.py: what a rank of an NCCL launch sees."""

import torch
import torch.distributed as dist

from zero_lab.launch import init_worker, report

info = init_worker()
total = torch.tensor([float(info.rank + 1)], device=info.device)
dist.all_reduce(total)
report({"backend": info.backend, "device": str(info.device),
        "current_device": torch.cuda.current_device(), "sum": total.item()})
