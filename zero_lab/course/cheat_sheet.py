"""The cheat sheet a learner keeps: `python -m zero_lab.course.cheat_sheet` writes
`zero_lab/practice/cheat_sheet.md` (tests/test_cheat_sheet.py holds the page to this module).

Every number on the page is computed here, never typed: the bytes a rank holds come from
`memory.model_state_bytes` (its coefficients in Ψ and N read off two world sizes, checked on
a second Ψ), the bytes a step sends from `collectives.volume.zero_volume` over each stage's
collectives, the worked example from `model_state_bytes` in GiB, the accumulation rows from
`predict.knobs.accumulation_volume` and the stage choice from `projection.recommend` (the
figure `course/decision_plot.py` draws). Only the names are text,
and each DeepSpeed key and Megatron-LM flag below was checked against its source:

DeepSpeed (deepspeedai/DeepSpeed at edaa7221): docs/_pages/config-json.md for
    "zero_optimization": {"stage"}, reduce_bucket_size, allgather_bucket_size, overlap_comm,
    stage3_prefetch_bucket_size, zero_hpz_partition_size, gradient_accumulation_steps,
    train_micro_batch_size_per_gpu, "bf16": {"enabled"}, communication_data_type and the
    "activation_checkpointing" section; deepspeed/runtime/config.py (0.19.8)
    _REMOVED_ZERO_CONFIG_KEYS: mics_shard_size (MiCS) is refused, MiCS removed;
    deepspeed/runtime/activation_checkpointing/checkpointing.py for checkpoint().
Megatron-LM (NVIDIA/Megatron-LM at d98e8a64): megatron/training/arguments.py for
    --use-distributed-optimizer, --overlap-grad-reduce, --overlap-param-gather,
    --ddp-bucket-size, --data-parallel-sharding-strategy {no_shard, optim, optim_grads,
    optim_grads_params}, --num-distributed-optimizer-instances, --recompute-activations,
    --accumulate-allreduce-grads-in-fp32, --grad-reduce-in-bf16; docs/user-guide/
    parallelism-guide.md and docs/user-guide/features/megatron_fsdp.md for
    --use-megatron-fsdp (optim = ZeRO-1, optim_grads = ZeRO-2, optim_grads_params = ZeRO-3)
    and --outer-dp-sharding-strategy; docs/user-guide/features/
    fine_grained_activation_offloading.md for --recompute-granularity; docs/user-guide/
    training-examples.md and docs/api-guide/core/generalized_tensor_parallel.md for
    --micro-batch-size, --global-batch-size and --bf16.
FSDP2 (torch 2.13, inspected): fully_shard(module, *, mesh, reshard_after_forward: bool | int,
    mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype, ...)) and FSDPModule's
    set_requires_gradient_sync, set_modules_to_forward_prefetch,
    set_modules_to_backward_prefetch.
"""

from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path

from zero_lab import memory
from zero_lab.collectives.volume import zero_volume
from zero_lab.course import decision_plot, models
from zero_lab.predict import micro_batches, projection
from zero_lab.predict.knobs import accumulation_volume

PAGE = Path(__file__).resolve().parent.parent / "practice" / "cheat_sheet.md"
STATES = ("params", "grads", "optimizer")
# the worked example: the course's Llama 3.1 8B on 8 GPUs (HSDP: groups of 4)
EXAMPLE = {"n_params": models.PSI_8B, "world_size": 8, "shard_size": 4}
HSDP = "HSDP"

# Each stage's collectives per step, as the course states them (02_collectives): the
# elements each sends, in multiples of Ψ. HSDP: inside the shard group of S ranks.
COLLECTIVES = {
    0: (("all_reduce", 1),),
    1: (("reduce_scatter", 1), ("all_gather", 1)),
    2: (("reduce_scatter", 1), ("all_gather", 1)),
    3: (("all_gather", 1), ("all_gather", 1), ("reduce_scatter", 1)),
}

NAMES = {  # stage: (FSDP2, DeepSpeed, Megatron-LM, choose it when)
    0: ("none: `DistributedDataParallel` (DDP)",
        '`"zero_optimization": {"stage": 0}`',
        "the default (no flag)",
        "the model states fit with room for activations"),
    1: ("no direct equivalent (torch: DDP + `ZeroRedundancyOptimizer`)",
        '`"zero_optimization": {"stage": 1}`',
        "`--use-distributed-optimizer`; Megatron-FSDP "
        "`--data-parallel-sharding-strategy optim`",
        "Adam's states do not fit; DDP's bytes at any accumulation k"),
    2: ("no direct equivalent; `fully_shard(m, reshard_after_forward=False)` is ZeRO-2-like "
        "(SHARD_GRAD_OP: parameters gathered once a step, kept through backward)",
        '`"zero_optimization": {"stage": 2}`',
        "`--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads`",
        "gradients do not fit either: DDP's bytes at k = 1, but (k+1)Ψ with k micro-batches "
        "(it reduce-scatters each one)"),
    3: ("`fully_shard(m, reshard_after_forward=True)` per block, then the root (the default)",
        '`"zero_optimization": {"stage": 3}`',
        "`--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params`",
        "the parameters themselves do not fit; {ratio}x the bytes"),
    HSDP: ('`fully_shard(m, mesh=init_device_mesh("cuda", (R, S), mesh_dim_names='
           '("replicate", "shard")))`',
           "none since DeepSpeed 0.19 (MiCS removed, DeepSpeed issue 8489); stage 3 + hpZ "
           '`"zero_hpz_partition_size": S` gathers inside a node but keeps states sharded '
           "over all N",
           "`--use-megatron-fsdp` with `--num-distributed-optimizer-instances R` "
           "(`--outer-dp-sharding-strategy no_shard`)",
           "stage 3 on several nodes: parameters never cross the network"),
}

# The knobs (08_knobs): FSDP2, DeepSpeed, Megatron-LM. hpZ (ZeRO++) is the int form of
# reshard_after_forward: a secondary parameter copy sharded inside a node, not HSDP.
KNOBS = (
    ("bucket size",
     "none: a `fully_shard` unit is one bucket (wrap per block)",
     "`reduce_bucket_size`, `allgather_bucket_size` (elements)",
     "`--ddp-bucket-size`"),
    ("overlap the gradient reduce",
     "always (reduce-scatter per unit in backward)",
     "`overlap_comm`",
     "`--overlap-grad-reduce`"),
    ("prefetch the next parameters",
     "implicit by default; explicit: `set_modules_to_forward_prefetch`, "
     "`set_modules_to_backward_prefetch`",
     "`stage3_prefetch_bucket_size`",
     "`--overlap-param-gather`"),
    ("`reshard_after_forward` int S",
     "`fully_shard(m, reshard_after_forward=S)`",
     'ZeRO++ hpZ `"zero_hpz_partition_size": S`',
     "none"),
    ("accumulation",
     "`m.set_requires_gradient_sync(False)` on all but the last micro-batch "
     "(DDP: `no_sync()`); between micro-batches FSDP2 holds the unsharded gradient in "
     "`reduce_dtype` (4 bytes a parameter with fp32)",
     "`gradient_accumulation_steps`, `train_micro_batch_size_per_gpu`",
     "`--micro-batch-size`, `--global-batch-size`"),
    ("precision policy",
     "`mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
     "reduce_dtype=torch.float32)`",
     '`"bf16": {"enabled": true}`, `communication_data_type`',
     "`--bf16`, `--accumulate-allreduce-grads-in-fp32` / `--grad-reduce-in-bf16`"),
    ("activation checkpointing",
     "`torch.utils.checkpoint` (or `checkpoint_wrapper`) on each block, before `fully_shard`",
     '`"activation_checkpointing"` section + `deepspeed.checkpointing.checkpoint`',
     "`--recompute-activations` (selective), `--recompute-granularity full`"),
)


# --------------------------------------------------------------------------- numbers


def coefficients(stage: int, psi: int = 4_000_000) -> dict[str, tuple[Fraction, Fraction]]:
    """{state: (a, b)} such that a rank holds (a·Ψ + b·Ψ/N) bytes of it at `stage`, read off
    `memory.model_state_bytes` (mixed precision, Adam) at N = 2 and 4 and checked at N = 8 and
    on a second Ψ, so a formula that is not of that form is refused, not misprinted."""
    def per_param(n_params: int, world: int, key: str) -> Fraction:
        return Fraction(memory.model_state_bytes(n_params, stage, world)[key], n_params)

    out = {}
    for key in (*STATES, "total"):
        f2, f4 = per_param(psi, 2, key), per_param(psi, 4, key)
        b = 4 * (f2 - f4)  # f(N) = a + b/N
        a = f2 - b / 2
        for n_params, world in ((psi, 8), (3 * psi, 2), (3 * psi, 8)):
            if per_param(n_params, world, key) != a + b / world:
                raise ValueError(f"stage {stage} {key}: not a·Ψ + b·Ψ/N")
        out[key] = (a, b)
    return out


def sent_per_step(stage: int, psi: int = 1_000_000) -> Fraction:
    """Elements one rank sends a step, in multiples of Ψ (the ZeRO paper's convention)."""
    return Fraction(sum(zero_volume(op, k * psi) for op, k in COLLECTIVES[stage]), psi)


def term(a: Fraction, b: Fraction, n: str = "N") -> str:
    """'2Ψ + 12Ψ/N', '16Ψ/N', '0' from the coefficients."""
    def num(x: Fraction) -> str:
        return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"
    parts = ([f"{num(a)}Ψ"] if a else []) + ([f"{num(b)}Ψ/{n}"] if b else [])
    return " + ".join(parts) or "0"


def gib(nbytes: int) -> str:
    return f"{nbytes / memory.GiB:.1f} GiB"


# --------------------------------------------------------------------------- the page


def row(stage) -> str:
    n = "S" if stage == HSDP else "N"
    coef = coefficients(3 if stage == HSDP else stage)
    holds = " + ".join(term(*coef[k], n) for k in STATES) + f" = {term(*coef['total'], n)}"
    psi, world, shard = EXAMPLE["n_params"], EXAMPLE["world_size"], EXAMPLE["shard_size"]
    if stage == HSDP:
        inside = sent_per_step(3)
        across = Fraction(zero_volume("all_reduce", 1_000_000), 1_000_000)
        sends = f"{term(inside, 0)} in the group + {term(0, across, 'S')} across"
        example = f"{gib(memory.model_state_bytes(psi, 3, shard)['total'])} (S = {shard})"
        label = "HSDP (R groups of S)"
    else:
        sends = term(sent_per_step(stage), 0)
        example = gib(memory.model_state_bytes(psi, stage, world)["total"])
        label = str(stage)
    fsdp2, deepspeed, megatron, when = NAMES[stage]
    when = when.format(ratio=f"{float(sent_per_step(3) / sent_per_step(0)):g}")
    cells = [label, holds, sends, example, fsdp2, deepspeed, megatron, when]
    return "| " + " | ".join(cells) + " |"


def accumulation_rows(k: int = 8) -> list[str]:
    """One row per way a stage accumulates (`predict.micro_batches`): what it sends per
    optimizer step, as a formula in k and at `k`, and what it does."""
    rows = []
    for (stage, mode), how in micro_batches.HOW.items():
        name = f"{stage}" + (" (gradients unsharded)" if (stage, mode) == (3, "unsharded") else "")
        value = accumulation_volume(stage, k, grad_accumulation=mode)
        rows.append(f"| {name} | {micro_batches.volume_formula(stage, mode)} | {value:g}Ψ | "
                    f"{how} |")
    return rows


def choosing(k: int = 8) -> list[str]:
    """The rule `projection.recommend` keeps, with one worked change from the figure."""
    ratio = accumulation_volume(2, k) / accumulation_volume(1, k)
    psi = EXAMPLE["n_params"]
    one, many = (decision_plot.gpt_recommendation(psi, 8, a) for a in (1, k))
    return [
        "## Choosing a stage",
        "",
        f"`projection.recommend` (notebook 07): the stages that fit with a "
        f"{projection.RESERVE_FRACTION:.0%} reserve, then the fastest projected step, ties "
        f"(within {projection.TIE:.0%}) to fewer bytes per optimizer step, then to more "
        "headroom. With k micro-batches per optimizer step the bytes are the "
        f"accumulation's: at k = {k} stage 2 sends {ratio:g}x stage 1's, so stage 1 wins "
        f"wherever it fits ({decision_plot.label(psi)} on 8 x 80 GiB GPUs: stage {one.stage} "
        f"at k = 1, stage "
        f"{many.stage} at k = {k}). Tensor parallelism does not shrink fully sharded states "
        "below 16Ψ/N; it divides activations.",
        "",
        f"![recommend's choice by model size and GPU count, k = 1 and {k}]"
        f"(../../figures/{decision_plot.NAME}.png)",
        "",
        f"| stage | sends per optimizer step | at k = {k} | with k micro-batches it |",
        "| --- | --- | --- | --- |",
        *accumulation_rows(k),
        "",
    ]


def render() -> str:
    """The whole page, as `python -m zero_lab.course.cheat_sheet` writes it."""
    psi_b = decision_plot.label(EXAMPLE["n_params"])
    paper, megatron = memory.bytes_per_param(), memory.bytes_per_param(grad_bytes=4)
    lines = [
        "# ZeRO and FSDP on one page",
        "",
        "<!-- Generated by `python -m zero_lab.course.cheat_sheet` from zero_lab/memory.py, "
        "zero_lab/collectives/volume.py and zero_lab/predict; do not edit by hand. -->",
        "",
        "Ψ parameters, N data-parallel ranks, mixed precision with Adam (bf16 parameters and "
        f"gradients, fp32 master + m + v: K = {paper['optimizer']}). Bytes a rank holds are "
        "params + grads + optimizer states; a step sends the ZeRO paper's count, in "
        "elements, without the ring's (N-1)/N. Activations and buffers are extra. Terms: the "
        "[glossary](glossary.md).",
        "",
        f"| stage | each rank holds (bytes) | sends per step | {psi_b} on "
        f"{EXAMPLE['world_size']} GPUs | FSDP2 | DeepSpeed | Megatron-LM | choose it when |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *(row(s) for s in (*memory.STAGES, HSDP)),
        "",
        "Megatron-LM with bf16 keeps fp32 gradients, its main_grad (`grad_bytes=4` in "
        f"`memory.model_state_bytes`): {megatron['total']} bytes a parameter, not "
        f"{paper['total']}.",
        "",
        *choosing(),
        "## The knobs",
        "",
        "| knob | FSDP2 | DeepSpeed | Megatron-LM |",
        "| --- | --- | --- | --- |",
        *("| " + " | ".join(k) + " |" for k in KNOBS),
        "",
        "Notebook 08 prices each knob in bytes, memory and time; notebook 09 runs the FSDP2 "
        "column in `fsdp2_train.py`.",
        "",
    ]
    return "\n".join(lines)


def write(path: Path = PAGE) -> Path:
    path.write_text(render(), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(f"wrote {write(Path(argv[0]) if argv else PAGE)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
