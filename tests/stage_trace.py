"""What a reader of a stage has to follow: one steady step of `shard(model, k)`, traced.

Run on 2 gloo ranks (tests/test_stage_trace.py launches it): the course GPT (tied head) and
a small MLP (6 x Linear(256, 256)), default options, fp32, Adam. Rank 0 runs `sys.settrace` around
  - `shard()` and the first step: every file of zero_lab/ that runs ("files executed");
  - the third step (a steady one: orders learnt, buffers made): forward, `loss.backward()`,
    `opt.step()`, `opt.zero_grad()`. Every file of zero_lab/ with a line run there ("files
    run"); of them, those with a line of the mechanism run (below) are the files the reader
    follows to understand the step ("files to follow"): an add-on's module (a check, an
    option, the ledger, a profiler mark) is opened by a reader who wants that add-on. The
    plain stages (zero_lab/plain/) are traced the same way, for comparison.
Of the distinct lines run in zero_lab/stages/ in the steady step, the share that is the
mechanism: a line counts as the mechanism when the function it runs in is one the plain stage
has too (the hooks, the buckets and units, the collectives, landing a result, the step and
zero_grad on the slices: `MECHANISM` below), and as an add-on when the function does
something the plain stage leaves out (options, checks, refusals, instrumentation:
`ADD_ONS`). The unit is the function (its qualified name), so a branch for an option inside a
mechanism function would count as mechanism, so within a mechanism function a line whose code
(comments aside) names an add-on (`ADD_ON_WORDS`: `defers`, `lockstep`, `wide`, `_event`, ...)
counts as an add-on. Comments and docstrings never run, so never count. A function in neither
table is reported as unclassified (the test fails on one: classify it).
"""

from __future__ import annotations

import linecache
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

PACKAGE = Path(__file__).resolve().parents[1] / "zero_lab"

# stages/<file>: qualified names of functions that are the plain stage's mechanism
MECHANISM = {
    "gradient_sync.py": {"_weak_hook", "GradientSync.gradient_arrived",
                         "GradientSync.queue_backward_callback", "GradientSync.groups_ready",
                         "GradientSync.backward_over", "GradientSync.groups_left",
                         "GradientSync.before_step",
                         "GradientSync.all_gather_params", "GradientSync.land_reductions",
                         "clear_grads", "FullGradients.__init__", "FullGradients.zero_grad",
                         "FullGradients.adopt", "FullGradients.adopt_all"},
    "ddp.py": {"DataParallel.on_grad", "DataParallel.on_group_ready",
               "DataParallel.end_of_backward", "DataParallel.zero_grad"},
    "zero1.py": {"Zero1.on_grad", "Zero1.on_group_ready", "Zero1.end_of_backward",
                 "Zero1.reduce_when_backward_ends",
                 "Zero1.reduce_gradients", "Zero1.before_step", "Zero1.after_step",
                 "Zero1.zero_grad", "Zero1._land_slice",
                 "Zero1._pre_divide"},
    "zero2.py": {"Zero2.on_grad", "Zero2.end_of_backward", "Zero2.after_step", "Zero2.zero_grad",
                 "ShardedGradients.add", "ShardedGradients.send", "ShardedGradients.land",
                 "ShardedGradients.zero_grad"},
    "zero3.py": {"Zero3.gather", "Zero3.release", "Zero3._release_unkept",
                 "Zero3._forward_start", "Zero3._pre_forward",
                 "Zero3._post_forward", "Zero3._forward_end", "Zero3._pre_backward",
                 "Zero3.on_group_ready", "Zero3.end_of_backward", "Zero3.before_step",
                 "Zero3.after_step", "Zero3.zero_grad", "_tensors",
                 "_in_backward", "Zero3._give_out_grads", "Zero3._take_grads",
                 "Zero3.on_grad", "Unit.start_gather", "Unit.finish_gather",
                 "Unit.release", "Unit.pieces", "Unit.gathered", "Unit.busy", "Unit.params",
                 "ShardedPart.start_gather", "ShardedPart.finish_gather", "ShardedPart.release",
                 "ShardedPart.pieces"},
    "partition.py": {"FlatParamGroup.new_full", "FlatParamGroup.new_shard",
                     "FlatParamGroup.shard", "FlatParamGroup.views", "FlatParamGroup.view",
                     "FlatParamGroup.reduce_scatter", "FlatParamGroup.all_gather",
                     "FlatParamGroup.all_reduce", "FlatParamGroup.flat", "free_storage",
                     "regrow_storage", "allocate_storage", "FlatParamGroup.shard_range",
                     "InFlight.send", "InFlight.land", "InFlight._land_oldest"},
    "sharded_optimizer.py": {"ShardedOptimizer.step", "ShardedOptimizer.zero_grad",
                             "ShardedOptimizer._step", "ShardedOptimizer._update"},
}


# A line of a mechanism function that names one of these serves an add-on (an option's branch,
# a check, a refusal, a mark for a trace, the fp32 reduction, no_sync's bookkeeping).
ADD_ON_WORDS = re.compile(
    r"defers|_syncing|_held\b|held\b|lockstep|check_|refuse|replicated|wide|main_grad|overlap|"
    r"_event|mark\(|_kept|_withheld|reshard|post_group|frozen|_late|_pending_inputs|"
    r"find_unused|has_grad|unsynced|_arrived_here|_arrived_unsynced|agree_on_grads|"
    r"abandon|_checked|_record|_derailed|_position|_gathers|forget_gradients|"
    r"is_compiling|compile|param_gather|rounding|fresh_start|_holds_average|reduce_in_step|"
    r"variant|_grads_in|step_starts|before_first_collective|listen|"
    # a call into an add-on's module counts as the add-on too: stage 3's unit order and
    # prefetch (unit_order.py, `self.order.`; a prefetch is a gather with wait=False), and
    # the overlapped all-gathers' wait (param_gather.py)
    r"\.order\.|wait=False|wait_for_params")


def classify(rel: str, qualname: str, line: int | None = None) -> str:
    """"mechanism", "add-on" or "unclassified" for a line of a function of zero_lab/stages/
    (with `line`, a mechanism function's line that names an add-on word is an add-on)."""
    name = rel.removeprefix("stages/")
    qualname = qualname.split(".<locals>.")[0]  # a lambda or comprehension: its function's
    if qualname in MECHANISM.get(name, ()):
        text = "" if line is None else linecache.getline(str(PACKAGE / rel), line)
        return "add-on" if ADD_ON_WORDS.search(text.split("#")[0]) else "mechanism"
    if qualname in ADD_ONS.get(name, ()) or name in ADD_ON_FILES:
        return "add-on"
    return "unclassified"


# Whole files of stages/ that the plain stage has nothing of: every function there an add-on.
ADD_ON_FILES = {"lockstep.py", "unused_params.py", "unit_order.py", "at_rest.py", "param_gather.py",
                "accumulation.py", "refusals.py", "buffers.py",
                "mixed_precision.py", "torch_clipping.py", "state_dicts.py", "recompute.py",
                "hybrid.py"}
# Functions of mechanism files that serve an option, a check or instrumentation.
ADD_ONS = {
    "gradient_sync.py": {"GradientSync.before_first_collective", "GradientSync.step_starts",
                         "GradientSync.defers", "GradientSync.forget_gradients",
                         "GradientSync.group_sharded",
                         "GradientSync.abandon_unfinished_backward",
                         "GradientSync.wait_for_params", "GradientSync.land_through",
                         "GradientSync.settle", "GradientSync.landing_order"},
    "zero1.py": set(), "ddp.py": set(),
    "zero2.py": {"Zero2.defers", "Zero2.grad_buffers", "ShardedGradients.abandon"},
    "zero3.py": {"Zero3._event", "Zero3._keep_gathered", "Zero3._keep_1_of_d",
                 "Zero3._watch_inputs", "Zero3._inputs_done", "Zero3.before_first_collective",
                 "Zero3.defers", "Zero3.grad_buffers", "Unit.drop_post",
                 "Unit.reshard_after_forward", "Unit.name"},
    "partition.py": {"FlatParamGroup.sends"},
    "sharded_optimizer.py": {"_refuse_step"},
}


class Tracer:
    """Lines of zero_lab/ run while it is on: {(file relative to zero_lab/, line): function}."""

    def __init__(self) -> None:
        self.lines: dict[tuple[str, int], str] = {}

    def _local(self, frame, event, _arg):
        if event == "line":
            code = frame.f_code
            self.lines[(self._rel(code.co_filename), frame.f_lineno)] = code.co_qualname
        return self._local

    def _global(self, frame, event, _arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            code = frame.f_code
            self.lines.setdefault((self._rel(code.co_filename), code.co_firstlineno),
                                  code.co_qualname)
            return self._local
        return None

    @staticmethod
    def _rel(filename: str) -> str:
        return str(Path(filename).relative_to(PACKAGE))

    def __enter__(self) -> Tracer:
        sys.settrace(self._global)
        return self

    def __exit__(self, *_exc) -> None:
        sys.settrace(None)

    def files(self) -> list[str]:
        """The package's files that ran (course/: the loop's batches and loss, not the stage)."""
        return sorted({f for f, _ in self.lines if not f.startswith("course/")})


def make_model(name: str) -> torch.nn.Module:
    from zero_lab.course.models import GPT
    from zero_lab.course.workloads import TinyGPT, deep_mlp

    torch.manual_seed(0)
    return TinyGPT(**GPT) if name == "gpt" else deep_mlp(256, 6)


def one_step(name: str, model, opt, step: int) -> None:
    from zero_lab.course.workloads import (
        gpt_batch,
        mlp_batch,
        mse_loss,
        next_token_loss,
        rank_slice,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    if name == "gpt":
        loss = next_token_loss(model, rank_slice(gpt_batch(step, 8, 16, 64), rank, world))
    else:
        loss = mse_loss(model, rank_slice(mlp_batch(step, 8, 256), rank, world))
    loss.backward()
    opt.step()
    opt.zero_grad()


def trace_stage(shard, stage: int, name: str, steady: int = 2) -> dict:
    """shard() + the first step traced, steps up to `steady` untraced, step `steady` traced."""
    model = make_model(name)
    with Tracer() as setup:
        model, opt = shard(model, stage)
        one_step(name, model, opt, 0)
    for step in range(1, steady):
        one_step(name, model, opt, step)
    with Tracer() as steady_step:
        one_step(name, model, opt, steady)
    stage_lines = {(f, n): q for (f, n), q in steady_step.lines.items()
                   if f.startswith("stages/")}
    kinds: dict[str, list[str]] = {"mechanism": [], "add-on": [], "unclassified": []}
    for (f, n), q in sorted(stage_lines.items()):
        kinds[classify(f, q, n)].append(f"{f}:{n} {q}")
    return {"files_executed": setup.files(), "files_run": steady_step.files(),
            "files_to_follow": sorted({line.split(":")[0] for line in kinds["mechanism"]}),
            "stage_lines": len(stage_lines), "mechanism": kinds["mechanism"],
            "add_ons": kinds["add-on"],
            "mechanism_lines": len(kinds["mechanism"]), "add_on_lines": len(kinds["add-on"]),
            "unclassified": sorted({line.split(" ", 1)[1] + " (" + line.split(":")[0] + ")"
                                    for line in kinds["unclassified"]}),
            "mechanism_share": len(kinds["mechanism"]) / max(1, len(stage_lines))}


def main() -> None:
    from zero_lab.launch import report
    from zero_lab.plain import stage1, stage2, stage3
    from zero_lab.stages import shard

    def plain_shard(module):
        def run(model, _stage):
            return module.shard(model, lambda ps: torch.optim.Adam(ps, lr=1e-3))
        return run

    # The plain stages take no tied weight: they are traced on the MLP only, and first (the
    # real stages install global optimizer-step hooks that every later step runs).
    out = {"plain mlp": {k: trace_stage(plain_shard(m), k, "mlp")
                         for k, m in ((1, stage1), (2, stage2), (3, stage3))}}
    out.update({f"real {name}": {k: trace_stage(shard, k, name) for k in (1, 2, 3)}
                for name in ("gpt", "mlp")})
    report(out if dist.get_rank() == 0 else {})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    main()
    dist.destroy_process_group()
