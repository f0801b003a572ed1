"""Notebook 08's rank work for two knobs: recompute and the precision policy, in one launch.

    torchrun(WORKERS / "knob_recompute_precision.py", nproc=2, args=["--steps", 4])

(notebook 08 runs `recompute_runs` and `precision_runs` from workers/knobs_demo.py, in the
launch that also measures accumulation.)

Recompute. A GPT of `--layers` blocks trains at stages 0-3 with `checkpoint_activations`
off and on (Adam, the same global batch per step, split over the ranks). Per (stage,
recompute): the step's peak memory (zero_lab.measure.memory.PeakMemory, last step), the model
states held, the collectives one step sends ([op, dtype, elements] each, CommLedger), the
groups' layout (for the formula), the step times (all but the measured step) and a digest of
the weights (recompute must not change one bit).

Precision policy. The same GPT at stage `--policy-stage` in bf16 under four recipes: plain,
LayerNorms kept in fp32, gradients reduced in fp32, both. Per recipe: the largest weight
difference from one process with the same recipe and the recipe's own difference from fp32
training (one process each), the collectives of one step, the groups' layout, and the dtype
each LayerNorm and Linear computed with and received.

Reported by rank 0 under "recompute" and "precision"; the parent side checks them with
zero_lab.grading.nb08_knobs_recompute and prices them with zero_lab.predict.recompute.
"""

from __future__ import annotations

import argparse
import hashlib
from functools import partial

import torch
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.course import workloads as W
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard
from zero_lab.stages.mixed_precision import group_layout, mixed_precision_reference


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split over the ranks")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--policy-stage", type=int, default=3)
    return parser.parse_args(argv)


SEED = 7

RECIPES = {
    "bf16": {},
    "bf16+keep_ln": {"keep_fp32": (nn.LayerNorm,)},
    "bf16+reduce_fp32": {"reduce_dtype": torch.float32},
    "bf16+keep_ln+reduce_fp32": {"keep_fp32": (nn.LayerNorm,), "reduce_dtype": torch.float32},
}


class Setup:
    """The model, the batches and this rank's place: what every run below starts from."""

    def __init__(self, args: argparse.Namespace, rank: int, world_size: int) -> None:
        self.args, self.rank, self.n = args, rank, world_size

    def model(self) -> nn.Module:
        a = self.args
        torch.manual_seed(SEED)
        return W.TinyGPT(vocab_size=a.vocab, seq_len=a.seq, d_model=a.width, n_heads=a.heads,
                         n_layers=a.layers, bias=False)

    def global_batch(self, step: int):
        return W.gpt_batch(step, self.args.batch, self.args.seq, self.args.vocab)

    def local_batch(self, step: int):
        return W.rank_slice(self.global_batch(step), self.rank, self.n)


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode() + state[key].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def ledger_step(setup: Setup, model, opt) -> list[list]:
    with CommLedger() as ledger:
        W.next_token_loss(model, setup.local_batch(setup.args.steps)).backward()
        opt.step()
        opt.zero_grad()
    return ledger.signature()


def recompute_run(setup: Setup, stage: int, recompute: bool) -> dict:
    model, opt = shard(setup.model(), stage, adam, checkpoint_activations=recompute)
    res = W.train(model, opt, setup.local_batch, W.next_token_loss, setup.args.steps)
    return {"stage": stage, "recompute": recompute, "peak_bytes": res["peak_bytes"],
            "held_bytes": res["held_after_step"]["total"], "step_times": res["step_times"],
            "digest": digest(full_state_dict(model)), "groups": group_layout(opt.sync),
            "ledger": ledger_step(setup, model, opt)}


def one_process(setup: Setup, recipe: str | None) -> dict[str, torch.Tensor]:
    """Weights after the same steps in one process on the global batch: fp32 (None), or
    the recipe's mixed precision."""
    model = setup.model()
    if recipe is None:
        opt = adam(list(model.parameters()))
    else:
        model, opt = mixed_precision_reference(model, adam, torch.bfloat16,
                                               keep_fp32=RECIPES[recipe].get("keep_fp32", ()))
    W.train(model, opt, setup.global_batch, W.next_token_loss, setup.args.steps,
            measure_memory=False)
    return full_state_dict(model) if recipe is None else opt.full_state_dict(model)


def distance(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def precision_run(setup: Setup, recipe: str, fp32: dict) -> dict:
    stage = setup.args.policy_stage
    model, opt = shard(setup.model(), stage, adam, precision="bf16", **RECIPES[recipe])
    res = W.train(model, opt, setup.local_batch, W.next_token_loss, setup.args.steps)
    reference = one_process(setup, recipe)
    seen: dict[str, list[str]] = {}

    def look(name, module, inputs) -> None:
        seen.setdefault(name, [str(module.weight.dtype), str(inputs[0].dtype)])

    hooks = [m.register_forward_pre_hook(partial(look, name))
             for name, m in model.named_modules() if isinstance(m, (nn.LayerNorm, nn.Linear))]
    weights = full_state_dict(model)
    ledger = ledger_step(setup, model, opt)
    for h in hooks:
        h.remove()
    return {"recipe": recipe, "stage": stage,
            "from_reference": distance(weights, reference),
            "reference_from_fp32": distance(reference, fp32),
            "held_bytes": res["held_after_step"]["total"], "peak_bytes": res["peak_bytes"],
            "step_times": res["step_times"], "groups": group_layout(opt.sync), "ledger": ledger,
            "seen": seen}


def recompute_runs(args: argparse.Namespace, rank: int, world_size: int) -> list[dict]:
    """Stages 0-3, recompute off and on."""
    setup = Setup(args, rank, world_size)
    return [recompute_run(setup, s, r) for s in (0, 1, 2, 3) for r in (False, True)]


def precision_runs(args: argparse.Namespace, rank: int, world_size: int) -> list[dict]:
    """The four recipes at stage `args.policy_stage`."""
    setup = Setup(args, rank, world_size)
    fp32_weights = one_process(setup, None)
    return [precision_run(setup, name, fp32_weights) for name in RECIPES]


def main() -> None:
    args = parse_args()
    info = init_worker()
    rank, n = info.rank, info.world_size
    recompute = recompute_runs(args, rank, n)
    precision = precision_runs(args, rank, n)
    report({"world_size": n, "args": vars(args), "recompute": recompute,
            "precision": precision} if rank == 0 else {})


if __name__ == "__main__":
    main()
