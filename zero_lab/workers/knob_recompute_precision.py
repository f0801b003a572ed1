"""Notebook 08's rank work for two knobs: recompute and the precision policy, in one launch.

    torchrun(WORKERS / "knob_recompute_precision.py", nproc=2, args=["--steps", 4])

Recompute. A GPT of `--layers` blocks trains at stages 0-3 with `checkpoint_activations`
off and on (Adam, the same global batch per step, split over the ranks). Per (stage,
recompute): the step's peak memory (zero_lab.measured.PeakMemory, last step), the model
states held, the collectives one step sends ([op, dtype, elements] each, CommLedger), the
groups' layout (for the formula), the step times (all but the measured step) and a digest of
the weights (recompute must not change one bit).

Precision policy. The same GPT at stage `--policy-stage` in bf16 under four recipes: plain,
LayerNorms kept in fp32, gradients reduced in fp32, both. Per recipe: the largest weight
difference from one process with the same recipe and the recipe's own difference from fp32
training (one process each), the collectives of one step, the groups' layout, and the dtype
each LayerNorm and Linear computed with and received.

Reported by rank 0 under "recompute" and "precision"; the parent side checks them with
zero_lab.grading.nb08_knobs_recompute and prices them with zero_lab.recompute_tradeoff.
"""

from __future__ import annotations

import argparse
import hashlib
from functools import partial

import torch
from torch import nn

from zero_lab import workloads as W
from zero_lab.collectives import CommLedger
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard
from zero_lab.stages.mixed_precision import mixed_precision_reference

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--batch", type=int, default=8, help="global batch, split over the ranks")
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--vocab", type=int, default=64)
parser.add_argument("--policy-stage", type=int, default=3)
args = parser.parse_args()
info = init_worker()
rank, n = info.rank, info.world_size
SEED = 7

RECIPES = {
    "bf16": {},
    "bf16+keep_ln": {"keep_fp32": (nn.LayerNorm,)},
    "bf16+reduce_fp32": {"reduce_dtype": torch.float32},
    "bf16+keep_ln+reduce_fp32": {"keep_fp32": (nn.LayerNorm,), "reduce_dtype": torch.float32},
}


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return W.TinyGPT(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width,
                     n_heads=4, n_layers=args.layers, bias=False)


def global_batch(step: int):
    return W.gpt_batch(step, args.batch, args.seq, args.vocab)


def local_batch(step: int):
    return W.rank_slice(global_batch(step), rank, n)


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode() + state[key].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def ledger_step(model, opt) -> list[list]:
    with CommLedger() as ledger:
        W.next_token_loss(model, local_batch(args.steps)).backward()
        opt.step()
        opt.zero_grad()
    return sorted([r.op, r.dtype, r.numel] for r in ledger.records)


def layout(sync) -> list[dict]:
    return [{"padded": g.padded_numel, "numel": g.numel, "dtype": str(g.dtype),
             "reduce_fp32": type(g).__name__ == "ReducedInFp32",
             "replicated": sync.replicated[i]} for i, g in enumerate(sync.groups)]


def recompute_run(stage: int, recompute: bool) -> dict:
    model, opt = shard(make_model(), stage, adam, checkpoint_activations=recompute)
    res = W.train(model, opt, local_batch, W.next_token_loss, args.steps)
    return {"stage": stage, "recompute": recompute, "peak_bytes": res["peak_bytes"],
            "held_bytes": res["held_after_step"]["total"], "step_times": res["step_times"],
            "digest": digest(full_state_dict(model)), "groups": layout(opt.sync),
            "ledger": ledger_step(model, opt)}


def one_process(recipe: str | None) -> dict[str, torch.Tensor]:
    """Weights after the same steps in one process on the global batch: fp32 (None), or
    the recipe's mixed precision."""
    model = make_model()
    if recipe is None:
        opt = adam(list(model.parameters()))
    else:
        model, opt = mixed_precision_reference(model, adam, torch.bfloat16,
                                               keep_fp32=RECIPES[recipe].get("keep_fp32", ()))
    W.train(model, opt, global_batch, W.next_token_loss, args.steps, measure_memory=False)
    return full_state_dict(model) if recipe is None else opt.full_state_dict(model)


def distance(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def precision_run(recipe: str, fp32: dict) -> dict:
    model, opt = shard(make_model(), args.policy_stage, adam, precision="bf16",
                       **RECIPES[recipe])
    res = W.train(model, opt, local_batch, W.next_token_loss, args.steps)
    reference = one_process(recipe)
    seen: dict[str, list[str]] = {}

    def look(name, module, inputs) -> None:
        seen.setdefault(name, [str(module.weight.dtype), str(inputs[0].dtype)])

    hooks = [m.register_forward_pre_hook(partial(look, name))
             for name, m in model.named_modules() if isinstance(m, (nn.LayerNorm, nn.Linear))]
    weights = full_state_dict(model)
    ledger = ledger_step(model, opt)
    for h in hooks:
        h.remove()
    return {"recipe": recipe, "stage": args.policy_stage,
            "from_reference": distance(weights, reference),
            "reference_from_fp32": distance(reference, fp32),
            "held_bytes": res["held_after_step"]["total"], "step_times": res["step_times"],
            "groups": layout(opt.sync), "ledger": ledger, "seen": seen}


recompute = [recompute_run(s, r) for s in (0, 1, 2, 3) for r in (False, True)]
fp32_weights = one_process(None)
precision = [precision_run(name, fp32_weights) for name in RECIPES]
if rank == 0:
    report({"world_size": n, "args": vars(args), "recompute": recompute,
            "precision": precision})
else:
    report({})
