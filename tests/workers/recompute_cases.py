"""Per-rank worker for tests/test_recompute.py and tests/test_precision_policy.py.

Two knobs of shard() on the small GPT of the stages tests (three blocks, LayerNorms, a tied
head), stages 0-3, 3 steps of Adam, each against one process on the global batch:
- `checkpoint_activations=True` (recompute.py): the weights, a step's collectives and the
  last step's peak memory, with and without;
- the precision policy (mixed_precision.py): bf16 with LayerNorms kept in fp32
  (`keep_fp32`), gradients reduced in fp32 (`reduce_dtype`), both; each recipe's distance
  from fp32 training and from one process with the same recipe, and its collectives.
tests/workers/world_cases.py runs it in the launch it shares with the other case workers.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from stage_cases import SEED, digest, local_batches, optimizer_function
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.course import workloads as W
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard
from zero_lab.stages.mixed_precision import group_layout, mixed_precision_reference

STEPS = 3
GLOBAL_BATCH = 12  # splits evenly over 1-4 ranks


def make_model() -> nn.Module:
    return W.TinyGPT(vocab_size=23, seq_len=8, d_model=16, n_heads=2, n_layers=3, bias=False)


def global_batch(step: int):
    return W.gpt_batch(step, GLOBAL_BATCH, 8, 23)


RECIPES = {  # name: shard() keywords of the precision policy, on top of precision="bf16"
    "bf16": {},
    "bf16+keep_ln": {"keep_fp32": (nn.LayerNorm,)},
    "bf16+reduce_fp32": {"reduce_dtype": torch.float32},
    "bf16+keep_ln+reduce_fp32": {"keep_fp32": (nn.LayerNorm,), "reduce_dtype": torch.float32},
}


def _models(rank: int):
    torch.manual_seed(SEED + rank)  # ranks start different: shard() broadcasts rank 0's
    model = make_model()
    torch.manual_seed(SEED)  # the reference starts from rank 0's initialisation
    return model, make_model()


def _ledger_step(model, opt, batch) -> list[list]:
    """One more step under the ledger: [op, dtype, numel] of every data collective."""
    with CommLedger() as ledger:
        W.next_token_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return ledger.signature()


def recompute_case(stage: int, recompute: bool, rank: int, world: int) -> dict:
    model, ref = _models(rank)
    adam = optimizer_function("adam")
    model, opt = shard(model, stage, adam, checkpoint_activations=recompute)
    ref_opt = adam(list(ref.parameters()))
    local = local_batches(global_batch, rank, world)
    res = W.train(model, opt, local, W.next_token_loss, STEPS)
    W.train(ref, ref_opt, global_batch, W.next_token_loss, STEPS, measure_memory=False)
    full, ref_full = full_state_dict(model), full_state_dict(ref)
    out = {
        "stage": stage, "recompute": recompute, "digest": digest(full),
        "max_abs_diff": max((full[k] - ref_full[k]).abs().max().item() for k in ref_full),
        "peak_bytes": res["peak_bytes"], "held_after_step": res["held_after_step"]["total"],
        "groups": group_layout(opt.sync),
        "ledger": _ledger_step(model, opt, local(STEPS)),
    }
    return out


def precision_case(stage: int, recipe: str, rank: int, world: int) -> dict:
    policy = RECIPES[recipe]
    model, ref = _models(rank)
    adam = optimizer_function("adam")
    model, opt = shard(model, stage, adam, precision="bf16", **policy)
    ref, ref_opt = mixed_precision_reference(ref, adam, torch.bfloat16,
                                             keep_fp32=policy.get("keep_fp32", ()))
    local = local_batches(global_batch, rank, world)
    res = W.train(model, opt, local, W.next_token_loss, STEPS)
    W.train(ref, ref_opt, global_batch, W.next_token_loss, STEPS, measure_memory=False)
    seen = {}  # the dtype each LayerNorm and Linear computes with, and what it receives

    def look(name, module, args) -> None:
        seen.setdefault(name, [str(module.weight.dtype), str(args[0].dtype)])

    hooks = [m.register_forward_pre_hook(partial(look, name))
             for name, m in model.named_modules() if isinstance(m, (nn.LayerNorm, nn.Linear))]
    full, ref_full = full_state_dict(model), ref_opt.full_state_dict(ref)
    ledger = _ledger_step(model, opt, local(STEPS))
    for h in hooks:
        h.remove()
    return {
        "stage": stage, "recipe": recipe, "ref_digest": digest(ref_full),
        "max_abs_diff": max((full[k].float() - ref_full[k].float()).abs().max().item()
                            for k in ref_full),
        "losses": res["losses"], "groups": group_layout(opt.sync), "ledger": ledger,
        "seen": seen, "held_after_step": res["held_after_step"],
        "n_trainable": W.count_parameters(ref, trainable_only=True),
    }


def fp32_weights() -> dict[str, torch.Tensor]:
    """One process, fp32, the global batch: what every recipe is measured against."""
    torch.manual_seed(SEED)
    model = make_model()
    W.train(model, optimizer_function("adam")(list(model.parameters())), global_batch,
            W.next_token_loss, STEPS, measure_memory=False)
    return full_state_dict(model)


def run(rank: int, world: int) -> dict:
    """Everything above at N = 2 and 4 (the issue's world sizes); N = 3 skips it (CI time)."""
    if world not in (2, 4):
        return {"skipped": True}
    start = time.perf_counter()
    recompute = [recompute_case(s, r, rank, world) for s in (0, 1, 2, 3) for r in (False, True)]
    precision = [precision_case(s, name, rank, world) for s in (0, 1, 2, 3)
                 for name in ("bf16+keep_ln", "bf16+reduce_fp32")]
    precision.append(precision_case(3, "bf16+keep_ln+reduce_fp32", rank, world))
    # Each recipe's one-process reference, against fp32 training: the recipe's own error.
    fp32 = fp32_weights()
    gaps = {}
    for name in RECIPES:
        torch.manual_seed(SEED)
        ref, ref_opt = mixed_precision_reference(make_model(), optimizer_function("adam"),
                                                 keep_fp32=RECIPES[name].get("keep_fp32", ()))
        W.train(ref, ref_opt, global_batch, W.next_token_loss, STEPS, measure_memory=False)
        weights = ref_opt.full_state_dict(ref)
        gaps[name] = max((weights[k].float() - fp32[k]).abs().max().item() for k in fp32)
    return {"recompute": recompute, "precision": precision, "fp32_gap": gaps,
            "seconds": time.perf_counter() - start}


def main() -> None:
    """This worker alone, e.g. to debug it: torchrun("tests/workers/recompute_cases.py", 2)."""
    info = init_worker()
    report(run(info.rank, info.world_size))


if __name__ == "__main__":
    main()
