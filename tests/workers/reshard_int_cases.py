"""Per-rank worker for tests/test_reshard_int.py: `reshard_after_forward=2` at stage 3 on 4
gloo ranks (FSDP2's int form; zero_lab/stages/zero3.py), in the world_cases launch at N = 4.

A 3 x Linear(33, 33) MLP, the first layer's bias frozen (a frozen part resharded too),
3 steps of Adam against one process on the global batch, for reshard_after_forward=2 and
True; the last step under a CommLedger, with the bytes each rank holds between forward and
backward (the 1/d copies) and after backward.
"""

from __future__ import annotations

import torch

from zero_lab.collectives import CommLedger
from zero_lab.course import workloads as W
from zero_lab.stages import full_state_dict, shard

D, BATCH, STEPS = 33, 8, 3


def make_model() -> torch.nn.Module:
    model = W.deep_mlp(D, depth=3)
    model[0].bias.requires_grad_(False)
    return model


def held_post(opt) -> int:
    """Bytes of the 1/d copies kept from forward to backward (zero3.Unit.post)."""
    return sum(t.nbytes for u in opt.sync.units for t in (u.post, u.frozen and u.frozen.post)
               if t is not None)


def run(rank: int, world: int) -> dict:
    out = {}
    for reshard in (2, True):
        torch.manual_seed(5)
        ref = make_model()
        torch.manual_seed(5)
        model, opt = shard(make_model(), 3, lambda ps: torch.optim.Adam(ps, lr=1e-2),
                           reshard_after_forward=reshard)
        ref_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
        for step in range(STEPS):
            x, y = W.mlp_batch(step, BATCH, D)
            W.mse_loss(ref, (x, y)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            local = W.rank_slice((x, y), rank, world)
            with CommLedger() as ledger:
                loss = W.mse_loss(model, local)
                between = held_post(opt)
                loss.backward()
                after = held_post(opt)
                opt.step()
                opt.zero_grad()
        full, want = full_state_dict(model), ref.state_dict()
        out[str(reshard)] = {
            "max_diff": max((full[k] - want[k]).abs().max().item() for k in want),
            "between": between, "after": after,
            "units": [[u.group.padded_numel, u.frozen.group.padded_numel if u.frozen else 0]
                      for u in opt.sync.units],
            "gathers": sorted([r.in_backward, r.world_size, r.level, r.nbytes, r.sent_bytes]
                              for r in ledger.records if r.op == "all_gather"),
            "scatters": sorted([r.world_size, r.nbytes, r.sent_bytes]
                               for r in ledger.records if r.op == "reduce_scatter"),
            "ops": sorted({r.op for r in ledger.records}),
        }
    return out
